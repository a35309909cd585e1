"""The operator in the Airflow features users combine it with, through the shared deployment's real
scheduler, triggerer and metadata DB (DAGs: tests/integration/dags/airflow_features_dags.py).

- mapped sweeps of a callable (``expand``, ``expand_kwargs``), sync and deferrable, bounded by
  ``max_active_tis_per_dag`` and by a pool that counts deferred tasks, each trial named by its
  ``map_index_template`` and its output bound to its own map index;
- ``execution_timeout`` while deferred: the run is stopped, the try times out, nothing is left;
- a durable retry that takes a run over gets what is left of the timeout, not a fresh one;
- a successful run's log has no error lines.

Every wait is on a marker (a file a rank writes, a state, a scheduler log line), never a sleep.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.integration.dags.airflow_features_dags import DEFERRED_TIMEOUT_S, LEARNING_RATES, RETRY_TIMEOUT_S
from tests.integration.deployment import ApiError, Deployment, quote, wait_for
from tests.integration.run_processes import run_tree, supervisor_above, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_supervisor_left")]

SWEEP_POOL = "torchdist_sweep"


def _gate(tmp_path: Path) -> Path:
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o777)
    return gate


def _mapped(deployment: Deployment, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    path = f"{deployment.ti_path(dag_id, run_id, 'train')}/listMapped"
    return sorted(deployment.call("GET", path)["task_instances"], key=lambda ti: ti["map_index"])


def _mapped_ti(deployment: Deployment, dag_id: str, run_id: str, map_index: int) -> dict[str, Any]:
    return deployment.call("GET", f"{deployment.ti_path(dag_id, run_id, 'train')}/{map_index}")


def _tries(deployment: Deployment, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    answer = deployment.call("GET", f"{deployment.ti_path(dag_id, run_id, 'train')}/tries")
    return sorted(answer["task_instances"], key=lambda t: t["try_number"])


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _spans(gate: Path, lr: float) -> tuple[float, float]:
    """When trial ``lr``'s ranks started (the first) and ended (the last)."""
    starts = [
        float(line.split()[1])
        for r in (0, 1)
        for line in (gate / f"started-{lr}-{r}").read_text().splitlines()
    ]
    ends = [float(line) for r in (0, 1) for line in (gate / f"ended-{lr}-{r}").read_text().splitlines()]
    return min(starts), max(ends)


def _check_sweep(deployment: Deployment, dag_id: str, run_id: str, gate: Path) -> None:
    run = deployment.wait_run(dag_id, run_id, timeout=600)
    assert run["state"] == "success", deployment.run_report(dag_id, run_id)
    mapped = _mapped(deployment, dag_id, run_id)
    assert [ti["rendered_map_index"] for ti in mapped] == [f"lr={lr}" for lr in LEARNING_RATES], mapped
    assert all(ti["state"] == "success" and ti["try_number"] == 1 for ti in mapped), mapped
    picked = deployment.xcom(dag_id, run_id, "best")
    assert [t["lr"] for t in picked["trials"]] == LEARNING_RATES
    assert all(t["world"] == 2 for t in picked["trials"]), picked
    losses = [t["loss"] for t in picked["trials"]]
    assert losses == sorted(set(losses), reverse=True), losses  # each trial trained with its own rate
    assert picked["best"]["lr"] == 0.3, picked
    # The Training view's API, per map index: each trial's own curve.
    for ti, trial in zip(mapped, picked["trials"], strict=True):
        figures = deployment.call(
            "GET", f"/torchdist/api/runs/{quote(dag_id)}/{quote(run_id)}/train?map_index={ti['map_index']}"
        )
        assert figures["state"] == "success" and figures["world_size"] == 2, figures
        assert len(figures["metrics"]) == 20 and figures["progress"]["fraction"] == 1.0, figures
        assert figures["metrics"][-1]["loss"] >= trial["loss"]  # the last step's loss, before its update
    # Each trial trained once, and never two at once on the cluster.
    for lr in LEARNING_RATES:
        for rank in (0, 1):
            assert len((gate / f"started-{lr}-{rank}").read_text().splitlines()) == 1
    spans = sorted(_spans(gate, lr) for lr in LEARNING_RATES)
    for (_, ended), (started, _) in zip(spans, spans[1:], strict=False):
        assert started > ended, spans
    # A successful run's log has no error lines (Airflow's client logged each missing link XCom).
    for ti in mapped:
        log = deployment.call(
            "GET",
            f"{deployment.ti_path(dag_id, run_id, 'train')}/logs/1?full_content=true&map_index={ti['map_index']}",
        )["content"]
        errors = [item for item in log if isinstance(item, dict) and item.get("level") == "error"]
        assert not errors, errors
        # Nor a stack trace at any level: torchrun's exit barrier once failed on a successful trial,
        # and its agent's stderr reached the log as info lines (spark/node/rendezvous.py).
        text = "\n".join(str(item.get("event", "")) if isinstance(item, dict) else str(item) for item in log)
        assert "Traceback" not in text and "exit barrier" not in text and "DistNetworkError" not in text, text


def test_a_callable_sweep_trains_each_trial_with_its_own_value_one_at_a_time(
    deployment: Deployment, tmp_path: Path
) -> None:
    gate = _gate(tmp_path)
    run_id = deployment.trigger("features_sweep", {"gate_dir": str(gate)})
    _check_sweep(deployment, "features_sweep", run_id, gate)


def _ensure_pool(deployment: Deployment, name: str, slots: int) -> None:
    body = {"name": name, "slots": slots, "include_deferred": True, "description": "torchdist tests"}
    try:
        deployment.call("POST", "/api/v2/pools", body)
    except ApiError as exc:
        if exc.status != 409:
            raise
        deployment.call("PATCH", f"/api/v2/pools/{quote(name)}", body)


def _deferral_reported(deployment: Deployment, dag_id: str, run_id: str, map_index: int) -> bool:
    """The scheduler has taken the executor's report of this mapped try's deferral (see
    ``Deployment.wait_deferral_reported``: before it, a trigger that fires races Airflow)."""
    line = (
        "Received executor event with state success for task instance "
        f"TaskInstanceKey(dag_id='{dag_id}', task_id='train', run_id='{run_id}', try_number=1, "
        f"map_index={map_index})"
    )
    return line in (deployment.home / "scheduler.log").read_text(errors="replace")


def test_a_deferrable_sweep_in_a_one_slot_pool_defers_each_trial_in_turn(
    deployment: Deployment, tmp_path: Path
) -> None:
    dag_id = "features_sweep_deferrable"
    _ensure_pool(deployment, SWEEP_POOL, 1)
    gate = _gate(tmp_path)
    run_id = deployment.trigger(dag_id, {"gate_dir": str(gate)})
    for map_index, lr in enumerate(LEARNING_RATES):
        wait_for(
            lambda lr=lr: all((gate / f"started-{lr}-{r}").exists() for r in (0, 1)),
            300,
            f"trial lr={lr}'s ranks to start",
            interval=0.2,
        )

        def deferred(map_index: int = map_index) -> bool:
            ti = _mapped_ti(deployment, dag_id, run_id, map_index)
            job = ti.get("triggerer_job") or {}
            return ti["state"] == "deferred" and job.get("state") == "running"

        wait_for(deferred, 120, f"trial {map_index} to be deferred on a live triggerer", interval=0.5)
        wait_for(
            lambda map_index=map_index: _deferral_reported(deployment, dag_id, run_id, map_index),
            60,
            f"the scheduler to take trial {map_index}'s deferral",
            interval=0.2,
        )
        # The pool counts the deferred trial: no other has started while it holds the slot.
        later = [x for x in LEARNING_RATES[map_index + 1 :] if (gate / f"started-{x}-0").exists()]
        assert not later, f"trials {later} started while trial lr={lr} held the pool's one slot"
        (gate / f"release-{lr}").touch()
    _check_sweep(deployment, dag_id, run_id, gate)


def _pids(gate: Path) -> dict[int, str]:
    return {
        int(line.split()[0]): f"rank {r}"
        for r in (0, 1)
        for line in (gate / f"started-run-{r}").read_text().splitlines()
    }


def _run_tree(gate: Path) -> tuple[dict[int, str], Path]:
    """The run whose ranks wrote their pids into ``gate``: its processes and its staging directory."""
    ranks = _pids(gate)
    return run_tree(supervisor_above(min(ranks)), ranks)


def _ranks_started(gate: Path) -> bool:
    return all((gate / f"started-run-{r}").exists() for r in (0, 1))


def test_execution_timeout_while_deferred_stops_the_run_and_times_the_try_out(
    deployment: Deployment, tmp_path: Path
) -> None:
    dag_id = "features_timeout_deferred"
    gate = _gate(tmp_path)
    run_id = deployment.trigger(dag_id, {"gate_dir": str(gate)})
    wait_for(lambda: _ranks_started(gate), 240, "both ranks to start", interval=0.2)
    deployment.wait_trigger(dag_id, run_id, "train")
    tree, staging = _run_tree(gate)

    ti = deployment.wait_state(dag_id, run_id, "train", {"failed", "success"}, timeout=180)
    ended = time.monotonic()
    assert ti["state"] == "failed" and ti["try_number"] == 1, ti
    took = _when(ti["end_date"]) - _when(ti["start_date"])
    assert DEFERRED_TIMEOUT_S <= took < DEFERRED_TIMEOUT_S + 30, (
        f"the try ended {took:.1f} s after it started; its execution_timeout is {DEFERRED_TIMEOUT_S} s"
    )
    log = deployment.task_log(dag_id, run_id, "train", 1)
    assert "AirflowTaskTimeout" in log and "passed the task's execution_timeout" in log, log[-3000:]
    # How the stop went, in the task log: the supervisor's stop line as the trigger followed it,
    # and the try's error.
    assert "stop requested (timeout)" in log and "How the stop went:" in log, log[-3000:]
    wait_gone(tree, staging, ended, 15, "the timeout")
    assert not (gate / "release").exists()


def test_a_durable_retry_that_takes_the_run_over_gets_what_is_left_of_the_timeout(
    deployment: Deployment, tmp_path: Path
) -> None:
    dag_id = "features_timeout_retry"
    gate = _gate(tmp_path)
    run_id = deployment.trigger(dag_id, {"gate_dir": str(gate)})
    wait_for(lambda: _ranks_started(gate), 240, "both ranks to start", interval=0.2)
    first = deployment.task_instance(dag_id, run_id, "train")
    task = deployment.task_pid(dag_id, run_id, "train")
    tree, staging = _run_tree(gate)
    os.kill(task, signal.SIGKILL)

    wait_for(
        lambda: deployment.task_instance(dag_id, run_id, "train")["try_number"] == 2,
        180,
        "try 2 to start",
    )
    ti = deployment.wait_state(dag_id, run_id, "train", {"failed", "success"}, timeout=180)
    ended = time.monotonic()
    assert ti["state"] == "failed" and ti["try_number"] == 2, ti
    log = deployment.task_log(dag_id, run_id, "train", 2)
    assert "AirflowTaskTimeout" in log and "passed the task's execution_timeout" in log, log[-3000:]
    # Trained once: try 2 took the run over, and stopped it at the deadline try 1 set.
    assert all(len((gate / f"started-run-{r}").read_text().splitlines()) == 1 for r in (0, 1))
    tries = _tries(deployment, dag_id, run_id)
    second = tries[-1]
    since_first = _when(second["end_date"]) - _when(first["start_date"])
    second_took = _when(second["end_date"]) - _when(second["start_date"])
    assert RETRY_TIMEOUT_S <= since_first < RETRY_TIMEOUT_S + 30, (
        f"stopped {since_first:.1f} s after try 1 started; the timeout is {RETRY_TIMEOUT_S} s"
    )
    assert second_took < RETRY_TIMEOUT_S - 5, (
        f"try 2 ran {second_took:.1f} s: it got a fresh timeout, not what was left"
    )
    wait_gone(tree, staging, ended, 15, "the timeout")


def test_setup_and_teardown_around_a_training_task_in_a_task_group(
    deployment: Deployment, tmp_path: Path
) -> None:
    dag_id = "features_task_group"
    gate = _gate(tmp_path)
    run_id = deployment.trigger(dag_id, {"gate_dir": str(gate)})
    run = deployment.wait_run(dag_id, run_id, timeout=300)
    assert run["state"] == "success", deployment.run_report(dag_id, run_id)
    # Every rank read the setup's workspace (its path came through args as an XComArg), rank 0's
    # value reached XCom, and the teardown removed the workspace after the training.
    assert deployment.xcom(dag_id, run_id, "training.train") == "ready"
    assert (gate / "torn-down").read_text() == "rank-0 rank-1"
    assert not (gate / "workspace").exists()


# -- a user's hand on a running task: mark success, clear ---------------------------------------------


def _lifetime_training(gate: Path) -> bool:
    return all((gate / f"training-{rank}").exists() for rank in (0, 1))


def _lifetime_tree(gate: Path) -> tuple[dict[int, str], Path]:
    """The run of a lifetime DAG (tests/integration/dags/lifetime_dags.py): its processes, with its
    ranks (by their pid files), and its staging directory."""
    ranks = [int((gate / f"training-{r}").read_text()) for r in (0, 1)]
    return run_tree(supervisor_above(ranks[0]), ranks)


def _clear(deployment: Deployment, dag_id: str, run_id: str) -> None:
    body = {"dry_run": False, "task_ids": ["train"], "dag_run_id": run_id, "only_failed": False}
    deployment.call("POST", f"/api/v2/dags/{quote(dag_id)}/clearTaskInstances", body)


@pytest.mark.parametrize("dag_id", ["lifetime_durable", "lifetime_deferrable"])
@pytest.mark.parametrize("action", ["mark_success", "clear"])
def test_mark_success_or_clear_of_a_running_training_task_stops_its_run(
    deployment: Deployment, tmp_path: Path, dag_id: str, action: str
) -> None:
    """Sync (durable: the kill must not be taken for a lost owner) and deferred. A cleared task
    runs again: a new run, which trains once the gate opens."""
    gate = _gate(tmp_path)
    run_id = deployment.trigger(dag_id, {"gate_dir": str(gate)})
    wait_for(lambda: _lifetime_training(gate), 240, "both ranks to be training", interval=0.2)
    if dag_id == "lifetime_deferrable":
        deployment.wait_trigger(dag_id, run_id, "train")
    tree, staging = _lifetime_tree(gate)
    for rank in (0, 1):
        (gate / f"training-{rank}").unlink()
    if action == "mark_success":
        deployment.call("PATCH", deployment.ti_path(dag_id, run_id, "train"), {"new_state": "success"})
    else:
        _clear(deployment, dag_id, run_id)
    acted = time.monotonic()
    wait_gone(tree, staging, acted, 15, action)
    if action == "clear":  # the task runs again: a new run, trained once, then the DAG run succeeds
        wait_for(lambda: _lifetime_training(gate), 240, "the new run's ranks to be training", interval=0.2)
        if dag_id == "lifetime_deferrable":
            deployment.wait_trigger(dag_id, run_id, "train")
        assert not set(_lifetime_tree(gate)[0]) & set(tree), "the cleared task reattached to the stopped run"
        (gate / "release").touch()
        run = deployment.wait_run(dag_id, run_id, timeout=240)
        assert run["state"] == "success", deployment.run_report(dag_id, run_id)
        assert deployment.xcom(dag_id, run_id, "check") == {"trained": True, "world": 2}
    else:
        deployment.wait_run(dag_id, run_id, timeout=240)
        assert deployment.task_instance(dag_id, run_id, "train")["state"] == "success"
