"""Checks of the environment a run is about to use, made before ``spark-submit`` starts.

Each turns what would otherwise be a slow or cryptic failure inside Spark (a minute of "All masters
are unresponsive", a ``FileNotFoundError`` from ``Popen``, ranks failing one by one on a driver
without GPUs) into an error that names the setting and says what to do, with nothing started.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed
from airflow_provider_torchdist.spark.node.checkpoint_store import local_path
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.validation import checkpoint_dir_path, output_dir_path

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
        "reachable on PATH (env_vars={'PATH': ...}). `python -m airflow_provider_torchdist doctor` checks "
        "this worker's set-up."
    )


def check_torch_here(why: str) -> None:
    """The ranks train in this Python (local mode, the embedded master): torch must import here.

    Checked before spark-submit, where a missing torch would otherwise be every rank's first error.
    """
    if importlib.util.find_spec("torch") is not None:
        return
    raise SparkSubmitFailed(
        f"torch is not installed in {sys.executable}, and {why}, so the ranks would train in this "
        "Python. Install it here (pip install 'airflow-provider-torchdist[spark]' brings it; for the "
        "CPU build first: pip install torch --index-url https://download.pytorch.org/whl/cpu), or "
        "point PYSPARK_PYTHON at a Python that has it. `python -m airflow_provider_torchdist doctor` "
        "checks this worker's set-up."
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


def check_checkpoint_dir(value: str | None) -> str | None:
    """A local ``checkpoint_dir`` (when set) must be a directory this worker can write.

    Absolute, a plain path or ``file:///`` URI (the checkpoint helpers use local paths), created
    0700 if missing, and written to once. Returns the resolved path.
    """
    if not value or local_path(value) is None:  # a remote store: probed by checkpoint_storage
        return None
    return check_writable_dir(checkpoint_dir_path(value), "checkpoint_dir", value)


def check_output_path(value: str) -> str | None:
    """A local ``output_path`` (plain path or ``file:///`` URI) must be a directory this worker can
    write, created 0700 if missing; remote storage (``s3://``, ...) is left to its client.

    Returns the resolved path, or None for remote storage.
    """
    path = output_dir_path(value)
    return None if path is None else check_writable_dir(path, "output_path", value)


def check_writable_dir(path: str, field: str, value: str) -> str:
    """Resolve ``path``, create it (0700) if missing, and write and remove a file there; else fail
    naming ``field``, before anything is staged or submitted."""
    resolved = os.path.realpath(path)
    try:
        _make_private_dirs(resolved)
        fd, probe = tempfile.mkstemp(prefix=".torchdist-write-test-", dir=resolved)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidTrainingConfig(
            f"{field} {value!r} (resolved to {resolved}) is not a directory this Airflow worker can "
            f"write: {exc.strerror or exc}. Make it a directory writable by the user the task runs as "
            f"(uid {os.geteuid()}), or set {field} to one."
        ) from None
    return resolved


def _make_private_dirs(path: str) -> None:
    """Create ``path`` and each missing parent, mode 0700: only this user can list or enter them."""
    missing = []
    while not os.path.isdir(path):
        if os.path.lexists(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile by another task: fine if it is a directory
            if not os.path.isdir(directory):
                raise


def check_gpu_conf(spec: TrainingSpec, target: SparkTarget, props: Mapping[str, str]) -> None:
    """``use_gpu`` needs Spark to schedule GPUs to the barrier tasks; say how when it does not."""
    if not spec.use_gpu:
        return
    if spec.local_mode:  # client mode: the ranks run on this machine
        check_local_gpus(spec.max_processes)  # local mode takes no range: the one size
        return
    if target.is_local:
        raise InvalidTrainingConfig(
            f"use_gpu=True in distributed mode needs a cluster: Spark's {target.master} master cannot "
            "assign GPUs to tasks (its tasks would wait forever). Use local_mode=True to run the ranks "
            "on the driver's GPUs, or a Spark connection to a GPU cluster."
        )
    if not props.get("spark.executor.resource.gpu.amount"):
        raise InvalidTrainingConfig(
            "use_gpu=True needs Spark to assign GPUs to tasks: set conf "
            "spark.executor.resource.gpu.amount (GPUs per executor) and, for standalone clusters, "
            "spark.executor.resource.gpu.discoveryScript (spark.task.resource.gpu.amount defaults to "
            f"nproc_per_node={spec.nproc_per_node}). Or run with use_gpu=False."
        )


def check_cluster_capacity(spec: TrainingSpec, target: SparkTarget, log: Any) -> float | None:
    """With the master's web UI known, fail before submitting when the cluster can never fit the job.

    Returns the driver's slot timeout: None (wait as long as it takes, saying so in the log) when
    the cluster can fit the stage once other work ends, ``slot_timeout`` when capacity is unknown.
    """
    if spec.local_mode or not target.master_web_ui:
        return spec.slot_timeout
    import requests

    try:
        state = requests.get(target.master_web_ui.rstrip("/") + "/json/", timeout=5).json()
    except (requests.RequestException, ValueError) as exc:
        log.warning("Could not read the Spark master's state at %s: %s", target.master_web_ui, exc)
        return spec.slot_timeout
    workers = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
    if spec.use_gpu:
        per_worker = [len((w.get("resources") or {}).get("gpu", {}).get("addresses", [])) for w in workers]
    else:
        per_worker = [int(w.get("cores", 0)) for w in workers]
    slots = sum(n // spec.nproc_per_node for n in per_worker)
    # An elastic run trains once MIN's nodes have joined and takes the others as slots free up:
    # only a cluster that can never fit MIN's nodes is a run that can never start.
    needed = spec.min_nodes if spec.elastic else spec.num_nodes
    if slots < needed:
        unit = "GPUs" if spec.use_gpu else "cores"
        what = (
            f"The elastic run (num_processes={spec.num_processes!r}) needs at least {needed} task "
            f"slot(s) of {spec.nproc_per_node} {unit} each at once to start (MIN={spec.min_processes} "
            "ranks)"
            if spec.elastic
            else f"The barrier stage needs {needed} task slot(s) of {spec.nproc_per_node} {unit} each at once"
        )
        raise InvalidTrainingConfig(
            f"{what}, but the cluster at {target.master} can never offer more than {slots} "
            f"({len(workers)} alive worker(s) with {unit} {per_worker}). Lower num_processes, change "
            "nproc_per_node, or add workers."
        )
    return None
