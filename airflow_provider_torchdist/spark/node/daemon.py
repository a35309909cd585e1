"""PySpark's Python daemon, with pyspark imported from its installed package.

An executor starts its Python daemon as ``python -m pyspark.daemon`` with ``pyspark.zip`` first on
``PYTHONPATH``, so every start compiles pyspark from sources (0.65 s instead of 0.15 s, before the
first barrier task can start). On a local master, whose executors run the hook's own interpreter,
the hook names this module ``spark.python.daemon.module``: it takes the zip off the path when it
is the installed package's own (:func:`~airflow_provider_torchdist.spark.node.pyspark_path.prefer_installed_pyspark`),
then runs ``pyspark.daemon`` exactly as Spark would have.
"""

from __future__ import annotations

import runpy

from airflow_provider_torchdist.spark.node.pyspark_path import prefer_installed_pyspark

#: What the hook sets ``spark.python.daemon.module`` to.
DAEMON_MODULE = "airflow_provider_torchdist.spark.node.daemon"

if __name__ == "__main__":
    prefer_installed_pyspark()
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
