"""The task's side of checkpoints (``operators/checkpoint_registry.py``) on real stores: a succeeded
run's checkpoints are marked finished and listed best first in XCom ``checkpoints``, a downstream
task loads one with ``load_checkpoint`` (safely), and older finished runs' default directories are
pruned."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist import load_checkpoint
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.checkpoint_registry import (
    CHECKPOINTS_XCOM_KEY,
    best_checkpoint,
    finish_checkpoints,
    prune_default_runs,
    run_identity,
    with_run_identity,
)
from airflow_provider_torchdist.outputs import run_paths
from airflow_provider_torchdist.spark.node.checkpoint_manifest import RUN_ENV, Manifest
from airflow_provider_torchdist.spark.node.checkpoint_state import CheckpointRefused
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.submit.checks import build_spec
from tests.object_store import S3Server
from tests.unit.conftest import FakeTI

LOG = logging.getLogger(__name__)


class PullingTI(FakeTI):
    """A downstream task instance: ``xcom_pull`` reads what the training task pushed."""

    def __init__(self, upstream: FakeTI) -> None:
        super().__init__()
        self.upstream = upstream

    def xcom_pull(self, task_ids: str, key: str) -> object:
        assert task_ids == self.upstream.task_id
        return self.upstream.pushed[key]


def saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def commit_steps(store: CheckpointStore, run: dict | None, losses: dict[int, float]) -> None:
    for step, loss in losses.items():
        manifest = Manifest(step=step, time=time.time() + step, metrics={"val_loss": loss}, run=run)
        store.commit(manifest, saved({"w": torch.tensor(float(step))}))


@pytest.fixture(params=["local", "s3"])
def spec_and_store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    settings = {"checkpoint_keep_best": 3, "checkpoint_metric": "val_loss"}
    if request.param == "local":
        uri = str(tmp_path / "ckpt")
        return build_spec(checkpoint_dir=uri, **settings), CheckpointStore(uri)
    server: S3Server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_STORE", server.connection_uri_env())
    uri = f"s3://{server.bucket()}/ckpt"
    spec = build_spec(checkpoint_dir=uri, checkpoint_conn_id="ckpt_store", **settings)
    return spec, CheckpointStore(uri, server.storage_options)


def test_the_kept_checkpoints_reach_xcom_best_first_and_load_downstream(spec_and_store) -> None:
    spec, store = spec_and_store
    ti = FakeTI()
    commit_steps(store, run_identity(ti), {2: 0.3, 3: 0.5, 4: 0.1, 6: 0.8})
    commit_steps(store, {**run_identity(ti), "run_id": "other"}, {9: 0.01})  # another DAG run's

    entries = finish_checkpoints(ti, spec, LOG)

    assert ti.pushed[CHECKPOINTS_XCOM_KEY] == entries
    assert [(e["step"], e["metrics"]) for e in entries] == [
        (4, {"val_loss": 0.1}),
        (2, {"val_loss": 0.3}),
        (3, {"val_loss": 0.5}),
        (6, {"val_loss": 0.8}),
    ]
    assert all(e["uri"].startswith(store.uri + "/step-") for e in entries)
    assert {m.step: m.finished for m in store.committed()} == {2: True, 3: True, 4: True, 6: True, 9: False}
    json.dumps(entries)  # XCom-serializable as it is
    assert best_checkpoint(entries) == {"best_checkpoint": entries[0]["uri"]}  # the asset event's share
    assert best_checkpoint([]) == {}
    downstream = PullingTI(ti)
    assert float(load_checkpoint(downstream, "best", task_id="train")["w"]) == 4.0
    assert float(load_checkpoint(entries, "latest")["w"]) == 6.0
    assert float(load_checkpoint(entries, 3)["w"]) == 3.0
    with pytest.raises(
        InvalidTrainingConfig, match=r"no kept checkpoint of step 5; the kept steps are \[2, 3, 4, 6\]"
    ):
        load_checkpoint(entries, 5)


def test_a_downstream_load_refuses_a_pickled_checkpoint(spec_and_store, tmp_path: Path) -> None:
    spec, store = spec_and_store
    ti = FakeTI()
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    store.commit(Manifest(step=1, time=time.time(), run=run_identity(ti)), saved({"model": Planted()}))
    entries = finish_checkpoints(ti, spec, LOG)
    with pytest.raises(CheckpointRefused, match=r"io.open.*Nothing in it was run"):
        load_checkpoint(entries)
    assert not marker.exists()


def test_the_ranks_learn_the_dag_run_they_train_for(tmp_path: Path) -> None:
    spec = with_run_identity(build_spec(checkpoint_dir=str(tmp_path)), FakeTI())
    assert json.loads(spec.rank_env[RUN_ENV]) == {
        "dag_id": "d",
        "run_id": "manual__1",
        "task_id": "train",
        "map_index": -1,
        "try_number": 1,
    }


def test_older_finished_runs_default_directories_are_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    ti = FakeTI()
    dirs = {}
    for age, run_id in enumerate(["r-newest", "r-older", "r-oldest"]):
        ti_of = FakeTI()
        ti_of.run_id = run_id
        dirs[run_id] = Path(run_paths.default_checkpoint_dir(ti_of))
        store = CheckpointStore(str(dirs[run_id]))
        manifest = Manifest(step=1, time=1000.0 - age, run=run_identity(ti_of), finished=True)
        store.commit(manifest, b"x")
    failed = FakeTI()
    failed.run_id = "r-failed"
    dirs["failed"] = Path(run_paths.default_checkpoint_dir(failed))
    CheckpointStore(str(dirs["failed"])).commit(Manifest(step=1, time=1.0, run=run_identity(failed)), b"x")
    own = run_paths.default_checkpoint_dir(ti)

    removed = prune_default_runs(ti, own, LOG, keep=2)

    assert removed == [str(dirs["r-older"]), str(dirs["r-oldest"])]
    assert dirs["r-newest"].is_dir() and dirs["failed"].is_dir()  # a failed run's retry resumes from it
    assert prune_default_runs(ti, str(tmp_path / "fixed"), LOG, keep=1) == []  # a set checkpoint_dir: never
