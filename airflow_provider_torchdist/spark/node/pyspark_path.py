"""Import pyspark from its installed package, not from the zip Spark puts first on the path.

spark-submit starts the Python driver, and an executor its Python daemon, with ``$SPARK_HOME/python/lib/pyspark.zip`` first on
``PYTHONPATH``. Python cannot cache bytecode for a zip of sources, so every driver compiles
pyspark again: importing it takes 0.55-0.6 s instead of 0.1 s (``python -X importtime``; the
daemon, 0.65 s instead of 0.15 s), twice on the path of every distributed run. The driver script
calls :func:`prefer_installed_pyspark` first; on a local master the executors' daemon does
(:mod:`~airflow_provider_torchdist.spark.node.daemon`). When Spark is the pip-installed ``pyspark`` (the embedded default),
that zip sits inside the very package this interpreter has installed
(``<site-packages>/pyspark/python/lib/pyspark.zip``, one wheel, one release): the zip's entry can
then go from ``sys.path`` and pyspark comes from the installed package, with its cached bytecode.
Anything else (a Spark distribution's ``SPARK_HOME``, a driver whose interpreter does not have that
``site-packages`` on its path) is left as Spark set it.

Example::

    prefer_installed_pyspark()   # before anything imports pyspark
    from pyspark import SparkContext
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from pathlib import Path


def prefer_installed_pyspark(
    path: list[str] | None = None, modules: Collection[str] | None = None
) -> str | None:
    """Remove pyspark's zip from ``path`` (default ``sys.path``) when it is the installed package's
    own; returns the entry removed (None when nothing was). Call it before pyspark is imported
    (``modules``, default ``sys.modules``, says whether it has been)."""
    path = sys.path if path is None else path
    if "pyspark" in (sys.modules if modules is None else modules):
        return None  # too late: it stays where it came from
    entries = {os.path.normpath(p) for p in path if p}
    for entry in path:
        zipped = Path(entry)
        if zipped.name != "pyspark.zip" or zipped.parent.name != "lib":
            continue
        package = zipped.parents[2]  # <site-packages>/pyspark/python/lib/pyspark.zip
        if package.name == "pyspark" and (package / "__init__.py").is_file():
            if os.path.normpath(str(package.parent)) in entries:
                path.remove(entry)
                return entry
    return None
