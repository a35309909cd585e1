"""What the ranks' ``save_checkpoint`` / ``load_latest_checkpoint`` do across DAG runs, on a local
directory and on a real S3 server (moto's, a separate process, reached by s3fs over HTTP): a new
DAG run never silently resumes another's checkpoints, retention keeps the newest and the best, and
a planted pickled checkpoint is refused by default. The run identity, retention settings and
storage options come through the environment, as the task stages them for every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    RUN_ENV,
    SETTINGS_ENV,
    STORAGE_OPTIONS_ENV,
    Manifest,
    Policy,
    Settings,
    run_env,
)
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spark.node.checkpoints import (
    CheckpointRefused,
    load_latest_checkpoint,
    save_checkpoint,
)
from tests.object_store import S3Server

LOSSES = [0.9, 0.3, 0.5, 0.1, 0.7, 0.8]  # val_loss after steps 1..6: best 4, 2, 3


class Planted:
    """What a compromised executor pickles: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


@pytest.fixture(params=["local", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fixed checkpoint_dir, as every rank of the task finds it."""
    monkeypatch.setenv("RANK", "0")
    if request.param == "local":
        value = str(tmp_path / "fixed-ckpt")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        value = f"s3://{server.bucket()}/fixed-ckpt"
        monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps(server.storage_options))
    monkeypatch.setenv(CHECKPOINT_ENV, value)
    return value


def as_task(monkeypatch: pytest.MonkeyPatch, run_id: str, try_number: int = 1, **settings: object) -> None:
    """The environment the operator stages for the ranks of ``retrain.train`` in DAG run ``run_id``."""
    monkeypatch.setenv(RUN_ENV, run_env("retrain", run_id, "train", -1, try_number))
    policy = Policy(**{k: v for k, v in settings.items() if k != "resume_from"})
    monkeypatch.setenv(
        SETTINGS_ENV, Settings(resume_from=settings.get("resume_from"), policy=policy).to_json()
    )


def train(steps: int = 4) -> int:
    """The documented loop: resume, then checkpoint every step. Returns the step it started at."""
    start, state = load_latest_checkpoint() or (0, None)
    for step in range(start, steps):
        save_checkpoint({"w": torch.tensor(float(step + 1))}, step + 1, metrics={"val_loss": LOSSES[step]})
    return start


def test_a_second_dag_run_with_the_same_fixed_dir_trains_from_the_start_and_says_so(
    uri: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: the second DAG run printed "resumed from epoch 4" and trained nothing."""
    as_task(monkeypatch, "scheduled__1")
    assert train() == 0
    as_task(monkeypatch, "scheduled__2")
    assert train() == 0  # the old code resumed run 1's step 4 here, and trained nothing
    said = capsys.readouterr().out
    assert "torchdist checkpoints: starting fresh (step 0)" in said
    assert "newest step 4 from DAG run 'scheduled__1' of retrain.train" in said
    assert "resume_from='latest'" in said
    # Run 1's checkpoints are still there: run 2 wrote prefixes of its own.
    runs = {m.run["run_id"] for m in CheckpointStore.from_env().committed()}
    assert runs == {"scheduled__1", "scheduled__2"}


def test_a_retry_of_the_same_dag_run_resumes_where_it_stopped(
    uri: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    as_task(monkeypatch, "scheduled__1")
    train(steps=3)
    as_task(monkeypatch, "scheduled__1", try_number=2)
    assert train(steps=5) == 3
    assert (
        "resuming from step 3, written by an earlier try or restart of this task" in capsys.readouterr().out
    )


def test_resume_from_latest_or_a_uri_resumes_another_runs_checkpoint(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_task(monkeypatch, "scheduled__1", keep_last=6)
    train(steps=4)
    as_task(monkeypatch, "manual__2", resume_from="latest")
    assert train(steps=5) == 4
    two = next(m for m in CheckpointStore.from_env().committed() if m.step == 2)
    as_task(monkeypatch, "manual__3", resume_from=CheckpointStore.from_env().uri_of(two))
    assert train(steps=3) == 2


def test_top_3_by_val_loss_and_the_newest_are_kept(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    as_task(monkeypatch, "scheduled__1", keep_last=1, keep_best=3, metric="val_loss", mode="min")
    train(steps=6)
    kept = CheckpointStore.from_env().committed()
    assert sorted(m.step for m in kept) == [2, 3, 4, 6]
    assert {m.step: m.metrics["val_loss"] for m in kept} == {2: 0.3, 3: 0.5, 4: 0.1, 6: 0.8}
    assert all(m.time > 0 and not m.finished for m in kept)


def test_a_planted_pickled_checkpoint_is_refused_and_runs_nothing(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another executor commits, properly, a checkpoint of this very run whose state unpickles to
    code; the restart's load refuses it and nothing in it runs."""
    as_task(monkeypatch, "scheduled__1")
    train(steps=2)
    marker = tmp_path / "pwned"
    planted = save_checkpoint({"model": Planted(marker)}, 999, weights_only=False)
    assert planted is not None and not marker.exists()
    with pytest.raises(
        CheckpointRefused, match=r"step-000000999.*it holds \['io.open'\].*Nothing in it was run"
    ):
        load_latest_checkpoint()
    assert not marker.exists()


def test_a_state_a_safe_load_would_refuse_is_refused_when_saved(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_task(monkeypatch, "scheduled__1")
    with pytest.raises(CheckpointRefused, match=r"save_checkpoint\(step=1\) refused the state"):
        save_checkpoint({"config": Planted(Path("/nonexistent"))}, 1)
    assert CheckpointStore.from_env().committed() == []


def test_other_ranks_write_nothing(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    as_task(monkeypatch, "scheduled__1")
    monkeypatch.setenv("RANK", "1")
    assert save_checkpoint({"w": torch.ones(1)}, 1) is None
    assert CheckpointStore.from_env().committed() == []


def test_a_manifest_records_who_wrote_it(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    as_task(monkeypatch, "scheduled__1", try_number=3)
    written = save_checkpoint({"w": torch.ones(1)}, 7, metrics={"val_loss": 0.5})
    assert written is not None and written.startswith(uri + "/step-000000007-")
    (manifest,) = CheckpointStore.from_env().committed()
    assert isinstance(manifest, Manifest)
    assert manifest.run == {
        "dag_id": "retrain",
        "run_id": "scheduled__1",
        "task_id": "train",
        "map_index": -1,
    }
    assert (manifest.step, manifest.try_number, manifest.metrics) == (7, 3, {"val_loss": 0.5})
