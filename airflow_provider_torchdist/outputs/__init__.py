"""Outputs and their trust: rank 0's value on its way to XCom and to later tasks.

The envelope a value travels in and ``load_output`` (``results``), its signature (``signing``), where
large values are stored (``storage``) and the run's paths (``run_paths``).

It may import ``spark`` and the package's core only.
"""
