"""Experiment tracking against a real MLflow tracking server (tests/integration/mlflow_server.py,
one for the file), read back with ``MlflowClient``: a DAG run's metrics, steps, params and tags; a
retry continuing its run; a mapped sweep as a parent with three children; a logged model that is
registered and loads back; and a server stopped mid-run (training succeeds; the metrics reported
while it was down are logged once it is back).

The four DAGs (tests/integration/fixtures/mlflow_dags) run once, in one Airflow process
(``dag.test()``), for all the tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.mlflow_server import MlflowServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1800),
    pytest.mark.usefixtures("no_supervisor_left"),
]

DAGS = Path(__file__).parent / "fixtures" / "mlflow_dags"
DAG_IDS = ["mlflow_metrics", "mlflow_retry", "mlflow_sweep", "mlflow_outage"]


def move_server_through_an_outage(server: MlflowServer, markers: Path, errors: list[BaseException]) -> None:
    """The outage DAG's rank 0 waits at ``phase1``: stop the server, say ``down``; at ``phase2``
    start it again, say ``up``."""
    import time

    def wait(name: str) -> None:
        deadline = time.monotonic() + 1200
        while not (markers / name).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(name)
            time.sleep(0.2)

    try:
        wait("phase1")
        server.stop()
        (markers / "down").touch()
        wait("phase2")
        server.start()
        (markers / "up").touch()
    except BaseException as exc:  # the test reports it
        errors.append(exc)
        (markers / "down").touch()
        (markers / "up").touch()


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], str, Any]]:
    """Run the DAGs against a fresh server; yields their states, the output, and an ``MlflowClient``."""
    from mlflow import MlflowClient

    from tests.integration.run_dags import run_in_fresh_airflow

    folder = tmp_path_factory.mktemp("mlflow")
    markers = folder / "markers"
    markers.mkdir()
    server = MlflowServer(folder)
    server.start()
    errors: list[BaseException] = []
    mover = threading.Thread(
        target=move_server_through_an_outage, args=(server, markers, errors), daemon=True
    )
    mover.start()
    env = {
        "AIRFLOW_CONN_MLFLOW_TEST": json.dumps({"conn_type": "mlflow", "host": server.uri}),
        "MLFLOW_TEST_MARKERS": str(markers),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    try:
        states, output = run_in_fresh_airflow(folder / "home", DAGS, DAG_IDS, env=env)
        mover.join(timeout=60)
        assert not errors, errors
        assert server.healthy(), "the server is back after the outage"
        yield states, output, MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
    finally:
        server.stop()


def runs_of(client: Any, dag_id: str, task_id: str = "train") -> list[Any]:
    experiment = client.get_experiment_by_name(dag_id)
    assert experiment is not None, f"no experiment {dag_id}"
    return list(
        client.search_runs([experiment.experiment_id], filter_string=f"tags.`airflow.task_id` = '{task_id}'")
    )


def steps(client: Any, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_dag_runs_metrics_steps_params_and_tags_are_in_its_mlflow_run(tracked) -> None:
    states, output, client = tracked
    assert states["mlflow_metrics"]["state"] == "success", output[-5000:]
    (run,) = [r for r in runs_of(client, "mlflow_metrics") if "torchdist.sweep_key" not in r.data.tags]
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == [0, 1, 2, 3]
    params, tags = run.data.params, run.data.tags
    assert params["args.0"] == "4" and params["kwargs.lr"] == "0.2"
    assert params["num_processes"] == "2" and params["world_size"] == "2" and params["nproc_per_node"] == "1"
    assert params["train_data"] == "SELECT id AS x FROM range(8)"
    assert params["conf.spark.ui.enabled"] == "false"
    assert tags["airflow.dag_id"] == "mlflow_metrics" and tags["airflow.task_id"] == "train"
    assert tags["airflow.run_id"] == states["mlflow_metrics"]["run_id"]
    assert tags["airflow.map_index"] == "-1" and tags["airflow.try_number"] == "1"
    assert tags["spark.app_id"].startswith(("app-", "local-")), tags
    assert "final/loss" in run.data.metrics and "duration_s" in run.data.metrics


def test_the_logged_model_is_registered_by_the_downstream_task_and_loads_back(tracked) -> None:
    import mlflow.pytorch
    import torch

    _, output, client = tracked
    (version,) = client.search_model_versions("name = 'torchdist-retrain'")
    (run,) = runs_of(client, "mlflow_metrics")
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(client.tracking_uri)
    mlflow.set_registry_uri(client.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/torchdist-retrain/{version.version}")
    assert isinstance(model, torch.nn.Linear)
    assert abs(float(model(torch.tensor([[1.0]]))) - 2.0) < 1.5  # it trained towards y = 2x


def test_a_retry_continues_the_same_mlflow_run(tracked) -> None:
    states, output, client = tracked
    assert states["mlflow_retry"]["state"] == "success", output[-5000:]
    (run,) = runs_of(client, "mlflow_retry")
    assert run.data.tags["airflow.try_number"] == "2"
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == [0, 1, 2, 3, 4, 5]  # both tries' steps, once each


def test_a_mapped_sweep_is_a_parent_run_with_a_child_per_trial_named_by_its_template(tracked) -> None:
    states, output, client = tracked
    assert states["mlflow_sweep"]["state"] == "success", output[-5000:]
    runs = runs_of(client, "mlflow_sweep")
    (parent,) = [r for r in runs if "torchdist.sweep_key" in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == ["lr=0.05", "lr=0.1", "lr=0.2"]
    assert sorted(r.data.params["kwargs.lr"] for r in children) == ["0.05", "0.1", "0.2"]
    assert all(steps(client, r.info.run_id) == [0, 1] for r in children)


def test_a_server_stopped_mid_run_costs_no_training_and_its_metrics_arrive_after_the_restart(tracked) -> None:
    states, output, client = tracked
    assert states["mlflow_outage"]["state"] == "success", output[-5000:]
    (run,) = runs_of(client, "mlflow_outage")
    assert steps(client, run.info.run_id) == list(range(9))  # those reported while it was down too
    assert "could not log metrics" in output and "answers again" in output, output[-5000:]
