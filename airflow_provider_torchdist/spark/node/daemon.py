"""PySpark's Python daemon, with pyspark imported from its installed package, and torch loaded
before it forks a barrier task's worker.

An executor starts its Python daemon as ``python -m pyspark.daemon`` with ``pyspark.zip`` first on
``PYTHONPATH``, so every start compiles pyspark from sources (0.65 s instead of 0.15 s, before the
first barrier task can start). On a local master, whose executors run the hook's own interpreter,
the hook names this module ``spark.python.daemon.module``: it takes the zip off the path when it
is the installed package's own (:func:`~airflow_provider_torchdist.spark.node.pyspark_path.prefer_installed_pyspark`),
then runs ``pyspark.daemon`` exactly as Spark would have.

With :data:`PRELOAD_ENV` set (a distributed run: ``spark.executorEnv``), the daemon imports the
launcher, and so torch and torchrun's agent, before it serves: each worker it forks starts with
them loaded. Each barrier task would otherwise import torch itself (1.7 s, both tasks at once on
the same cores); the daemon does it once (``bench/profile_launch.py``: worker start to launcher
ready, 2.15 s before, 1.87 s after). Nothing runs in torch here, so no thread pool exists to be
lost in the fork. The loaded heap is frozen (``gc.freeze``, as the Python docs advise before
forking workers: no collection in a worker touches, so copies, the daemon's pages), and the daemon
ends without interpreter teardown, which with torch loaded takes 0.4 s of the application's stop.
"""

from __future__ import annotations

import contextlib
import gc
import os
import runpy
import sys
from collections.abc import Mapping

from airflow_provider_torchdist.spark.node.pyspark_path import prefer_installed_pyspark

#: What the hook sets ``spark.python.daemon.module`` to.
DAEMON_MODULE = "airflow_provider_torchdist.spark.node.daemon"
#: Set to ``1`` in the daemon's environment: load the launcher (torch) before serving.
PRELOAD_ENV = "TORCHDIST_DAEMON_PRELOAD"
#: What the preload imports: the barrier task's launcher, which imports torch and its agent.
PRELOADED_MODULE = "airflow_provider_torchdist.spark.node.launcher"


def preload(environ: Mapping[str, str] = os.environ) -> bool:
    """Import the launcher when :data:`PRELOAD_ENV` asks for it, then freeze the heap; True if it did.

    A launcher that cannot be imported is left for the task to report (it imports it again, and
    fails with the error where the run's owner sees it)."""
    if environ.get(PRELOAD_ENV) != "1":
        return False
    try:
        __import__(PRELOADED_MODULE)
    except Exception:
        return False
    gc.freeze()
    return True


def serve() -> None:
    """Run ``pyspark.daemon`` as Spark would have; end with its exit code and no teardown."""
    code: object = 0
    try:
        runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # pyspark.daemon's shutdown(): stdin closed, or SIGTERM
        code = exc.code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    prefer_installed_pyspark()
    preload()
    serve()
