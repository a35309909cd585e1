"""Checks of the environment a run is about to use, made before ``spark-submit`` starts.

Each turns what would otherwise be a slow or cryptic failure inside Spark (a minute of "All masters
are unresponsive", a ``FileNotFoundError`` from ``Popen``, ranks failing one by one on a driver
without GPUs) into an error that names the setting and says what to do, with nothing started.
"""

from __future__ import annotations

import os
import shutil
import socket

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed

MASTER_CONNECT_TIMEOUT_S = 5.0


def check_master_reachable(master: str, conn_id: str, timeout: float = MASTER_CONNECT_TIMEOUT_S) -> None:
    """A ``spark://`` master must accept a TCP connection from here, where the client-mode driver runs.

    Spark's own client retries an unreachable master 3 times, 20 s apart, before it gives up.
    Other masters (``local``, ``yarn``, ``k8s://``) are not checked.
    """
    if not master.startswith("spark://"):
        return
    problems = []
    for address in master.removeprefix("spark://").split(","):  # standalone HA lists several
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return
        except ValueError:
            problems.append(f"{address}: no port, write spark://host:7077")
        except OSError as exc:
            problems.append(f"{address}: {exc.strerror or type(exc).__name__}")
    raise SparkSubmitFailed(
        f"Cannot reach the Spark master {master} ({'; '.join(problems)}), so nothing was submitted. "
        f"Check that the master is running and that the Spark connection {conn_id!r} names its host and "
        "port (spark://host:7077), reachable from this Airflow worker."
    )


def check_spark_binary(binary: str, path: str | None) -> None:
    """The ``spark-submit`` the hook will run must exist, on the PATH that spark-submit gets."""
    found = shutil.which(binary, path=path) if os.sep not in binary else binary
    if found and os.path.isfile(found) and os.access(found, os.X_OK):
        return
    where = f"PATH={path!r}" if os.sep not in binary else "that path"
    raise SparkSubmitFailed(
        f"spark-submit not found: the hook would run {binary!r}, and there is no such executable in "
        f"{where}. Install pyspark (it ships spark-submit) into the Python that runs Airflow, or set "
        "spark_binary (or the connection's spark-binary extra) to Spark's bin/spark-submit and make it "
        "reachable on PATH (env_vars={'PATH': ...})."
    )


def check_local_gpus(needed: int) -> None:
    """``use_gpu`` with ``local_mode``: the ranks run on this machine, one GPU each."""
    import torch

    have = torch.cuda.device_count()
    if have < needed:
        raise InvalidTrainingConfig(
            f"use_gpu=True with local_mode needs {needed} GPU(s) on the driver (this Airflow worker), "
            f"one per rank; torch sees {have}. Lower num_processes or run with use_gpu=False."
        )
