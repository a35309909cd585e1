"""A package that exists only in this directory: module-mode tests ship it with ``py_files``."""
