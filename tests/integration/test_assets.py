"""Live metrics and the trained model as an asset, on the real deployment (the session's shared
``deployment``: API server, scheduler, DAG processor, triggerer; see conftest.py).

One run of ``asset_gated_training`` (tests/integration/dags/asset_dags.py) serves both tests:

- while rank 0 waits at the gate, XCom ``metrics`` already holds its first three reports (pushed
  by the running task, throttled), read through the REST API; after the gate, the final push holds
  all four;
- its success emits an event for ``torchdist://models/retrain`` whose extra describes the run, and
  that event triggers ``evaluate_model`` (dags/evaluate_model.py), which returns the metrics it
  read from the event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.deployment import ApiError, Deployment, quote, wait_for

pytestmark = pytest.mark.integration

TRAINING = "asset_gated_training"
EVALUATION = "evaluate_model"
MODEL_URI = "torchdist://models/retrain"


@dataclass
class AssetRun:
    run_id: str
    #: XCom ``metrics`` as the REST API showed it while rank 0 waited at the gate.
    live_metrics: list[dict[str, Any]]
    #: The training task's state at that moment.
    live_state: str
    seconds_to_live_metrics: float


def _metrics_now(deployment: Deployment, run_id: str) -> list[dict[str, Any]] | None:
    try:
        return deployment.xcom(TRAINING, run_id, "train", "metrics")
    except ApiError as exc:
        if exc.status == 404:
            return None  # not pushed yet
        raise


@pytest.fixture(scope="module")
def asset_run(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> AssetRun:
    """The evaluation DAG unpaused (a paused DAG is not queued by an asset event), then one gated
    training: XCom ``metrics`` read while it waits at the gate, then released to its end."""
    deployment.wait_parsed(EVALUATION)
    deployment.call("PATCH", f"/api/v2/dags/{EVALUATION}", {"is_paused": False})
    gate = tmp_path_factory.mktemp("asset_gate")
    run_id = deployment.trigger(TRAINING, {"gate_dir": str(gate)})
    try:
        wait_for(lambda: (gate / "waiting").exists(), 240, "rank 0 to reach the gate", interval=0.5)
        reached = time.monotonic()

        def three_reports() -> list[dict[str, Any]] | None:
            metrics = _metrics_now(deployment, run_id)
            return metrics if metrics and len(metrics) >= 3 else None

        live = wait_for(three_reports, 30, "XCom metrics to hold the reports before the gate", interval=0.2)
        waited = time.monotonic() - reached
        state = deployment.task_instance(TRAINING, run_id, "train")["state"]
        assert not (gate / "release").exists()
    finally:
        (gate / "release").touch()  # never leave the run waiting, whatever failed
    final = deployment.wait_run(TRAINING, run_id, timeout=240)
    assert final["state"] == "success", deployment.run_report(TRAINING, run_id)
    return AssetRun(run_id, live, state, waited)


def test_xcom_metrics_are_pushed_while_the_run_is_still_going(
    deployment: Deployment, asset_run: AssetRun
) -> None:
    print(
        f"the first reports were in XCom {asset_run.seconds_to_live_metrics:.1f} s after rank 0 reached the gate"
    )
    assert asset_run.live_state == "running"
    assert [m["step"] for m in asset_run.live_metrics] == [0, 1, 2]
    assert all(m["rank"] == 0 and m["total_steps"] == 4 for m in asset_run.live_metrics)
    # The final push at the end holds the whole history.
    final = deployment.xcom(TRAINING, asset_run.run_id, "train", "metrics")
    assert [m["step"] for m in final] == [0, 1, 2, 3]
    assert final[:3] == asset_run.live_metrics


def _evaluation_of(deployment: Deployment, run_id: str) -> dict[str, Any] | None:
    """The ``evaluate_model`` run triggered by ``run_id``'s event, once it succeeded: its result."""
    runs = deployment.call("GET", f"/api/v2/dags/{EVALUATION}/dagRuns")["dag_runs"]
    for run in runs:
        if run["state"] == "failed":
            pytest.fail(deployment.run_report(EVALUATION, run["dag_run_id"]))
        if run["state"] != "success":
            continue
        result = deployment.xcom(EVALUATION, run["dag_run_id"], "read_metrics")
        if result["source"]["run_id"] == run_id:
            return {**result, "run_type": run["run_type"]}
    return None


def test_the_model_event_triggers_the_evaluation_dag_which_reads_its_metrics(
    deployment: Deployment, asset_run: AssetRun
) -> None:
    started = time.monotonic()
    result = wait_for(
        lambda: _evaluation_of(deployment, asset_run.run_id),
        180,
        f"{EVALUATION} to run on the model event of {asset_run.run_id}",
        interval=2,
    )
    print(f"{EVALUATION} succeeded {time.monotonic() - started:.1f} s after the training run")
    assert result["run_type"] == "asset_triggered"
    assert result["source"] == {"dag_id": TRAINING, "run_id": asset_run.run_id, "task_id": "train"}
    # The last report's values (total_steps is not a metric), as the training's XCom has them.
    history = deployment.xcom(TRAINING, asset_run.run_id, "train", "metrics")
    assert result["metrics"] == {"loss": history[-1]["loss"]} == {"loss": 0.125}
    assert result["step"] == 3
    assert (result["output_type"], result["output_format"]) == ("dict", "json")
    assert result["output_size"] > 0
    assert "output_ref" not in result  # a small value stays in XCom
    assert result["world_size"] == 2
    assert 0 < result["duration_s"] < 300
    # The event itself, as the REST API lists it.
    events = deployment.call("GET", f"/api/v2/assets/events?source_run_id={quote(asset_run.run_id)}")
    [event] = [e for e in events["asset_events"] if e["uri"] == MODEL_URI]
    extra = {k: v for k, v in result.items() if k not in ("source", "events", "run_type")}
    assert event["extra"] == extra
