"""The run-lifetime features over Spark Connect, in the shared real deployment: a deferrable run, and
a durable run whose task is SIGKILLed mid-training and whose retry reattaches.

The DAGs (``lifetime_connect_*`` in ``tests/integration/dags/lifetime_dags.py``) train at a gate the test opens, over
the ``torchdist_connect_lifetime`` connection (``spark_connect``) to the session's Connect server
(``local[2]``), which the ``connect_lifetime_conn`` fixture creates in the deployment through the
REST API. Over Connect the ranks run in the Connect server's Python workers (under its JVM), not
under the run's supervisor: the supervisor runs the Connect driver. So the supervisor is found from
the task process, or, once the task has deferred, as the one supervisor that appeared since the
test began; the helpers are ``test_run_lifetime``'s, the ``no_supervisor_left`` check ``run_processes``'.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from airflow_provider_torchdist.supervision.record import RunRecord
from tests.integration.connect_server import ConnectServer
from tests.integration.deployment import Deployment, quote, wait_for
from tests.integration.run_processes import supervisors
from tests.integration.test_run_lifetime import (
    _gate,
    _retry_reattaches_and_trains_once,
    _supervisor_of,
    _trigger_until_training,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_supervisor_left")]

CONN_ID = "torchdist_connect_lifetime"


@pytest.fixture(scope="module")
def connect_lifetime_conn(deployment: Deployment, connect_server: ConnectServer) -> Iterator[str]:
    """The ``spark_connect`` connection the DAGs use, to the session's Connect server, made in the
    running deployment through the REST API; deleted afterwards."""
    path = f"/api/v2/connections/{quote(CONN_ID)}"
    deployment.call(
        "POST",
        "/api/v2/connections",
        {
            "connection_id": CONN_ID,
            "conn_type": "spark_connect",
            "host": "127.0.0.1",
            "port": connect_server.port,
        },
    )
    try:
        yield CONN_ID
    finally:
        deployment.call("DELETE", path)


def _new_supervisors(deployment: Deployment, before: set[int]) -> dict[int, psutil.Process]:
    """The run supervisors of this deployment's tasks (staging under its home, or started with its
    AIRFLOW_HOME) not in ``before``."""
    found = {}
    for pid, proc in supervisors().items():
        with contextlib.suppress(psutil.Error):
            # A forked supervisor's environment is its task process's, unreadable (retitled): its
            # title names its staging directory, under the deployment's home (its TMPDIR).
            named = f"{deployment.home}{os.sep}" in " ".join(proc.cmdline())
            if pid not in before and (named or proc.environ().get("AIRFLOW_HOME") == str(deployment.home)):
                found[pid] = proc
    return found


def _stored_record(deployment: Deployment, dag: str, run_id: str, with_operation: bool) -> RunRecord | None:
    """The run's record in the task's ``task_state_store`` (None: none yet, or without the operation)."""
    try:
        answer = deployment.call(
            "GET", f"{deployment.ti_path(dag, run_id, 'train')}/state-store/torchdist_run"
        )
    except Exception:  # not stored yet
        return None
    value = answer.get("value", answer) if isinstance(answer, dict) else answer
    if isinstance(value, str):
        value = json.loads(value)
    record = RunRecord.from_dict(value)
    return record if record.connect_operation or not with_operation else None


def _ancestors(pid: int) -> list[int]:
    return [parent.pid for parent in psutil.Process(pid).parents()]


def _assert_ranks_on_the_connect_server(
    gate: Path, connect_server: ConnectServer, supervisor: psutil.Process
) -> None:
    """Both ranks run under the Connect server (its spark-submit leads their ancestry), none under the
    run's supervisor: the run really went over Connect."""
    for rank in (0, 1):
        pid = int((gate / f"training-{rank}").read_text())
        ancestors = _ancestors(pid)
        assert connect_server.pid in ancestors, (rank, pid, ancestors, connect_server.pid)
        assert supervisor.pid not in ancestors, (rank, pid, ancestors, supervisor.pid)


def test_a_deferrable_run_over_connect_trains_while_the_task_is_deferred_then_succeeds(
    deployment: Deployment, connect_server: ConnectServer, connect_lifetime_conn: str, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_connect_deferrable"
    before = set(supervisors())
    run_id = _trigger_until_training(deployment, dag, gate)
    deployment.wait_trigger(dag, run_id, "train")
    # The task has deferred (its process is gone): the run's supervisor is the one of this
    # deployment that appeared.
    new = _new_supervisors(deployment, before)
    assert len(new) == 1, {pid: " ".join(proc.cmdline())[:160] for pid, proc in new.items()}
    (supervisor,) = new.values()
    assert supervisor.is_running()
    _assert_ranks_on_the_connect_server(gate, connect_server, supervisor)
    (gate / "release").touch()

    final = deployment.wait_run(dag, run_id, timeout=240)
    assert final["state"] == "success", deployment.run_report(dag, run_id)
    assert deployment.xcom(dag, run_id, "check") == {"trained": True, "world": 2}
    metrics = deployment.xcom(dag, run_id, "train", key="metrics")
    assert [m.get("gate_open") for m in metrics] == [0, 1], metrics
    log = deployment.task_log(dag, run_id, "train", 1)
    assert "over Spark Connect" in log, log[-3000:]
    wait_for(lambda: not supervisor.is_running(), 30, "the supervisor to end after the run", interval=0.2)


def test_sigkill_of_a_durable_task_over_connect_is_survived_and_the_retry_reattaches(
    deployment: Deployment, connect_server: ConnectServer, connect_lifetime_conn: str, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_connect_durable"
    run_id = _trigger_until_training(deployment, dag, gate)
    task = deployment.task_pid(dag, run_id, "train")
    supervisor = _supervisor_of(task)
    _assert_ranks_on_the_connect_server(gate, connect_server, supervisor)
    # The task adds the run's Connect session and operation to its record in task_state_store (what
    # a retry that finds the supervisor gone interrupts the job with).
    record = wait_for(
        lambda: _stored_record(deployment, dag, run_id, with_operation=True), 60, "the operation"
    )
    os.kill(task, signal.SIGKILL)

    log = _retry_reattaches_and_trains_once(deployment, dag, run_id, task, supervisor, gate)
    assert "Reattaching to run" in log and "after-gate rank 0" in log, log[-3000:]
    assert f"connect-operation {record.connect_operation}" in log, log[-3000:]
    wait_for(lambda: not supervisor.is_running(), 30, "the supervisor to end after release", interval=0.2)
