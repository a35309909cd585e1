"""Shared set-up for the integration tests: an isolated Airflow home, leftover-process checks, and
the real Airflow deployment the DAG-level tests share (``deployment``; see ``deployment.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.integration.connect_server import (  # noqa: F401 (one Connect server per session)
    connect_conn,
    connect_server,
)
from tests.integration.deployment import Deployment, dag_folder, running_deployment

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session", autouse=True)
def isolated_airflow_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Keep the tests away from the user's ~/airflow and from any configured Spark connection."""
    home = str(tmp_path_factory.mktemp("airflow_home"))
    os.environ["AIRFLOW_HOME"] = home
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)
    return home


_RUN_PROCESS = ("pyspark", "torchdist", "org.apache.spark.deploy.SparkSubmit", "CoarseGrainedExecutorBackend")
#: A test cluster's own daemons (a test may start a lost Worker again): not part of any run.
_CLUSTER_DAEMON = ("org.apache.spark.deploy.worker.Worker", "org.apache.spark.deploy.master.Master")


def _run_processes() -> dict[int, str]:
    """Every live process on the machine that belongs to a training run (any session, any parent)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(daemon in cmd for daemon in _CLUSTER_DAEMON):
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in cmd for marker in _RUN_PROCESS):
            found[proc.info["pid"]] = cmd
    return found


@pytest.fixture
def no_leftovers():
    """Fail the test if a process it started (spark-submit, driver, Python workers, executors, agents,
    ranks) outlives it, whether still our child or orphaned to init."""
    before = set(_run_processes())
    yield
    deadline = time.monotonic() + 15
    while True:
        # New run processes that are still ours, or orphans (a process someone else started on the
        # machine meanwhile is neither).
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        left = {
            pid: cmd
            for pid, cmd in _run_processes().items()
            if pid not in before and (pid in ours or _parent(pid) == 1)
        }
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left running: {[(pid, cmd[:200]) for pid, cmd in left.items()]}"


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One real Airflow deployment for the whole session (``scripts/airflow-standalone`` in a temp
    AIRFLOW_HOME), serving dags/ and tests/integration/dags/; stopped, with nothing left, at the end.

    Tests share it: each triggers runs of its own DAGs and leaves no run going.
    """
    home = tmp_path_factory.mktemp("airflow_standalone_home")
    dags = dag_folder(tmp_path_factory.mktemp("airflow_standalone_dags"))
    with running_deployment(home, dags) as running:
        yield running
