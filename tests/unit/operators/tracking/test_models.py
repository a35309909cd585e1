"""mlflow_log_model's checkpoint fallback, against a real MLflow client (its file store): it logs
this DAG run's newest committed checkpoint, and never a file planted in the checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchdist.operators.tracking.models import log_trained_model
from airflow_provider_torchdist.spark.node.checkpoint_manifest import Manifest, step_dir
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore

RUN = {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1}


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store: no server needed
    return MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")


def artifacts(client, run_id: str, tmp_path: Path) -> dict[str, bytes]:
    if not client.list_artifacts(run_id, "checkpoint"):
        return {}
    got = Path(client.download_artifacts(run_id, "checkpoint", str(tmp_path / "download")))
    return {p.name: p.read_bytes() for p in got.iterdir()}


def test_the_newest_committed_checkpoint_of_this_run_is_logged(client, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.commit(Manifest(step=10, time=1.0, run=RUN), b"step 10")
    store.commit(Manifest(step=20, time=2.0, run=RUN), b"step 20")
    store.commit(Manifest(step=90, time=3.0, run={**RUN, "run_id": "another"}), b"another run's")
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    uri = log_trained_model(client, run_id, None, store, RUN)
    name = f"{step_dir(20, RUN)}.pt"
    assert uri == f"runs:/{run_id}/checkpoint/{name}"
    assert artifacts(client, run_id, tmp_path) == {name: b"step 20"}


def test_a_file_planted_in_the_checkpoint_directory_is_never_uploaded(client, tmp_path: Path) -> None:
    """Before, the newest ``step-*.pt`` of the directory was uploaded as it was: a symlink planted
    there by whoever can write it made the Airflow worker upload the file it points to (its
    configuration, its keys) to the tracking server."""
    secret = tmp_path / "airflow.cfg"
    secret.write_text("fernet_key = the worker's secret\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-999999999.pt").symlink_to(secret)
    (ckpt / step_dir(999, RUN)).symlink_to(tmp_path)  # a step's name, pointing elsewhere
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    assert log_trained_model(client, run_id, None, CheckpointStore(str(ckpt)), RUN) is None
    assert artifacts(client, run_id, tmp_path) == {}
