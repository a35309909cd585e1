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
ready, 2.15 s before, 1.87 s after). The import starts OpenBLAS's thread pool (numpy's), which
makes itself again in each forked child (its ``pthread_atfork`` handler); torch's own OpenMP pool
is made by the first parallel operation, and the daemon runs none. The loaded heap is frozen
(``gc.freeze``, as the Python docs advise before forking workers: no collection in a worker
touches, so copies, the daemon's pages), and the daemon ends without interpreter teardown, which
with torch loaded takes 0.4 s of the application's stop. A preload that fails is said on the
executor's stderr, and the daemon starts again without it (a half-imported torch stays nowhere):
the barrier task then imports the launcher itself and reports the error where the run's owner
sees it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import runpy
import sys
from collections.abc import Mapping
from typing import NoReturn

from airflow_provider_torchdist.spark.node.pyspark_path import prefer_installed_pyspark

#: What the hook sets ``spark.python.daemon.module`` to.
DAEMON_MODULE = "airflow_provider_torchdist.spark.node.daemon"
#: Set to ``1`` in the daemon's environment: load the launcher (torch) before serving.
PRELOAD_ENV = "TORCHDIST_DAEMON_PRELOAD"
#: What the preload imports: the barrier task's launcher, which imports torch and its agent.
PRELOADED_MODULE = "airflow_provider_torchdist.spark.node.launcher"


def preload(environ: Mapping[str, str] = os.environ) -> bool:
    """Import the launcher when :data:`PRELOAD_ENV` asks for it, then freeze the heap; True if it
    did. Raises what the import raised."""
    if environ.get(PRELOAD_ENV) != "1":
        return False
    __import__(PRELOADED_MODULE)
    gc.freeze()
    return True


def start_again_without_preload(error: BaseException) -> NoReturn:
    """Say why the preload failed, then this daemon again, as Spark started it, without it."""
    print(
        f"[torchdist] the Python daemon could not load {PRELOADED_MODULE} ({error!r}); "
        "it starts again without it",
        file=sys.stderr,
        flush=True,
    )
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}
    # The same command line, interpreter flags included (python [flags] -m <this module> [args]).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


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
    try:
        preload()
    except (Exception, SystemExit) as exc:  # an import that calls sys.exit() too
        start_again_without_preload(exc)
    serve()
