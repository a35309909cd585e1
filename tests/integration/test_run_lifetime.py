"""Runs that outlive their task on purpose, and only on purpose, in the shared real deployment.

Training waits at a gate the test opens (``tests/integration/dags/lifetime_dags.py``): the test
kills the task process while every rank is known to be training, never after a sleep.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.deployment import Deployment, wait_for
from tests.integration.run_processes import (
    is_supervisor,
    run_tree,
    staging_of,
    supervisor_above,
    wait_gone,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_supervisor_left")]


def _gate(tmp_path: Path) -> Path:
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o777)
    return gate


def _training(gate: Path) -> bool:
    return all((gate / f"training-{rank}").exists() for rank in (0, 1))


def _supervisor_of(task_pid: int) -> psutil.Process:
    """The run's supervisor: the task process's child that is one (forked from it, or a new interpreter)."""
    for child in psutil.Process(task_pid).children():
        if is_supervisor(child):
            return child
    raise AssertionError(f"task process {task_pid} has no run supervisor child")


def _run_tree(supervisor: psutil.Process, gate: Path) -> dict[int, str]:
    """Every process of the run: the supervisor, everything under it, and the ranks (by their pid files)."""
    return run_tree(supervisor, (int((gate / f"training-{rank}").read_text()) for rank in (0, 1)))[0]


def test_sigkill_of_a_non_durable_task_leaves_nothing_of_its_run_within_15_s(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    run_id = _trigger_until_training(deployment, "lifetime_nondurable", gate)
    task = deployment.task_pid("lifetime_nondurable", run_id, "train")
    supervisor = _supervisor_of(task)
    staging = staging_of(supervisor)
    tree = _run_tree(supervisor, gate)
    assert staging.is_dir() and len(tree) > 4, tree

    os.kill(task, signal.SIGKILL)
    killed = time.monotonic()
    wait_gone(tree, staging, killed, 15, "the task's SIGKILL")
    ti = deployment.wait_state("lifetime_nondurable", run_id, "train", {"failed"}, timeout=120)
    assert ti["try_number"] == 1


def test_sigkill_of_a_durable_task_is_survived_and_the_retry_reattaches(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_durable"
    run_id = _trigger_until_training(deployment, dag, gate)
    task = deployment.task_pid(dag, run_id, "train")
    supervisor = _supervisor_of(task)
    os.kill(task, signal.SIGKILL)

    log = _retry_reattaches_and_trains_once(deployment, dag, run_id, task, supervisor, gate)
    assert "before-gate rank 0" in log and "after-gate rank 0" in log, log[-3000:]
    wait_for(lambda: not supervisor.is_running(), 30, "the supervisor to end after release", interval=0.2)


def _trigger_until_training(deployment: Deployment, dag: str, gate: Path) -> str:
    """Trigger ``dag`` with ``gate``; returns the run id once both ranks train (held at the gate)."""
    run_id = deployment.trigger(dag, {"gate_dir": str(gate)})
    try:
        wait_for(lambda: _training(gate), 240, "both ranks to be training", interval=0.2)
    except pytest.fail.Exception as exc:
        # Where the run was (hunt 12 timed out here at a load of 10 to 13 on 2 cores, with no clue).
        pytest.fail(f"{exc}\n{deployment.run_report(dag, run_id)}")
    return run_id


def _retry_reattaches_and_trains_once(
    deployment: Deployment, dag: str, run_id: str, task: int, supervisor: psutil.Process, gate: Path
) -> str:
    """After try 1 (``task``) was SIGKILLed with its ranks at the gate: try 2 reattaches to the same
    supervisor, the gate opens, the DAG run succeeds, and each rank started once; returns try 2's log."""
    # The retry reattaches to the same supervisor while the ranks still wait at the gate.
    deployment.wait_state(dag, run_id, "train", {"running"}, timeout=180)
    wait_for(lambda: deployment.task_instance(dag, run_id, "train")["try_number"] == 2, 180, "try 2 to start")
    retry = deployment.task_pid(dag, run_id, "train")
    assert retry != task and supervisor.is_running()
    # Open the gate only once try 2 owns the run: opened as soon as its process exists, the run
    # could end before try 2 asks for it, and try 2 would take over the finished run's result
    # instead of reattaching (right too, but not what this test is for).
    wait_for(
        lambda: deployment.log_says(dag, run_id, "train", 2, "Reattaching to run"),
        120,
        "try 2 to reattach to the run",
        interval=0.5,
    )
    (gate / "release").touch()

    final = deployment.wait_run(dag, run_id, timeout=240)
    assert final["state"] == "success", deployment.run_report(dag, run_id)
    # Trained exactly once: one start per rank.
    for rank in (0, 1):
        assert len((gate / f"started-{rank}").read_text().splitlines()) == 1
    assert deployment.xcom(dag, run_id, "check") == {"trained": True, "world": 2}
    return deployment.task_log(dag, run_id, "train", 2)


def _supervisor_for(gate: Path) -> psutil.Process:
    """The supervisor of the run whose ranks wrote their pids into ``gate`` (a rank's ancestor)."""
    return supervisor_above(int((gate / "training-0").read_text()))


def test_a_deferrable_run_trains_while_the_task_is_deferred_then_succeeds(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_deferrable"
    run_id = _trigger_until_training(deployment, dag, gate)
    deployment.wait_trigger(dag, run_id, "train")
    assert _supervisor_for(gate).is_running()
    (gate / "release").touch()
    final = deployment.wait_run(dag, run_id, timeout=240)
    assert final["state"] == "success", deployment.run_report(dag, run_id)
    assert deployment.xcom(dag, run_id, "check") == {"trained": True, "world": 2}
    metrics = deployment.xcom(dag, run_id, "train", key="metrics")
    assert [m.get("gate_open") for m in metrics] == [0, 1], metrics


def test_mark_failed_while_deferred_leaves_nothing_of_the_run_within_15_s(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_deferrable"
    run_id = _trigger_until_training(deployment, dag, gate)
    deployment.wait_trigger(dag, run_id, "train")
    supervisor = _supervisor_for(gate)
    staging = staging_of(supervisor)
    tree = _run_tree(supervisor, gate)
    deployment.mark_failed(dag, run_id, "train")
    marked = time.monotonic()
    wait_gone(tree, staging, marked, 15, "mark-failed")


def test_a_durable_run_nobody_comes_back_for_is_torn_down_after_reattach_timeout(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag, reattach = "lifetime_no_owner", 20
    run_id = deployment.trigger(dag, {"gate_dir": str(gate), "reattach_timeout": reattach})
    wait_for(lambda: _training(gate), 240, "both ranks to be training", interval=0.2)
    task = deployment.task_pid(dag, run_id, "train")
    supervisor = _supervisor_of(task)
    staging = staging_of(supervisor)
    tree = _run_tree(supervisor, gate)
    os.kill(task, signal.SIGKILL)
    killed = time.monotonic()

    # No retry: the task fails while its durable run still waits for an owner...
    ti = deployment.wait_state(dag, run_id, "train", {"failed"}, timeout=60)
    assert ti["try_number"] == 1
    waited = time.monotonic() - killed
    assert waited < reattach and supervisor.is_running(), (
        f"the run did not wait for an owner: {waited:.1f} s after the kill, supervisor "
        f"{'alive' if supervisor.is_running() else 'gone'}"
    )
    # ...then tears itself down, all of it, once reattach_timeout has passed.
    gone = wait_gone(tree, staging, killed, reattach + 15, "the kill")
    assert gone >= reattach - 1, "the run was torn down before reattach_timeout"
    assert not (gate / "release").exists()


def test_a_triggerer_restart_mid_run_does_not_fail_the_run(deployment: Deployment, tmp_path: Path) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_deferrable"
    run_id = _trigger_until_training(deployment, dag, gate)
    before = deployment.wait_trigger(dag, run_id, "train")["triggerer_job"]["id"]
    supervisor = _supervisor_for(gate)

    deployment.restart_triggerer(signal.SIGTERM)
    deployment.wait_trigger(dag, run_id, "train", timeout=180, not_on=before)
    assert supervisor.is_running()
    (gate / "release").touch()

    final = deployment.wait_run(dag, run_id, timeout=240)
    assert final["state"] == "success", deployment.run_report(dag, run_id)
    assert deployment.xcom(dag, run_id, "check") == {"trained": True, "world": 2}
    for rank in (0, 1):
        assert len((gate / f"started-{rank}").read_text().splitlines()) == 1


def test_a_retry_without_the_record_is_refused_by_the_live_runs_checkpoint_lock(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    dag = "lifetime_locked"
    run_id = _trigger_until_training(deployment, dag, gate)
    task = deployment.task_pid(dag, run_id, "train")
    supervisor = _supervisor_of(task)
    staging = staging_of(supervisor)
    tree = _run_tree(supervisor, gate)
    os.kill(task, signal.SIGKILL)
    # The record is lost (deleted through the REST API): the retry cannot know of the live run.
    deployment.call("DELETE", f"{deployment.ti_path(dag, run_id, 'train')}/state-store/torchdist_run")

    final = deployment.wait_run(dag, run_id, timeout=240)
    assert final["state"] == "failed"
    ti = deployment.task_instance(dag, run_id, "train")
    assert ti["try_number"] == 2, ti
    log = deployment.task_log(dag, run_id, "train", 2)
    assert "another run of this task is live" in log and f"pid {supervisor.pid}" in log, log[-3000:]
    # Trained once: the live run, never a second copy beside it.
    for rank in (0, 1):
        assert len((gate / f"started-{rank}").read_text().splitlines()) == 1
    assert supervisor.is_running()

    supervisor.terminate()  # the run this test started: its supervisor's own teardown, by PID
    stopped = time.monotonic()
    wait_gone(tree, staging, stopped, 15, "SIGTERM")
