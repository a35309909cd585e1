"""Exact resume (``spark/node/resume_position.py``): a loop over ``rank_batches(..., epoch=e)`` that
checkpoints after each step, stopped and resumed, trains the same batches with the same random
numbers as one never stopped; a planted or broken position is refused with one line, and the
resume is then today's (epochs from their first batch).

Real files, real torch, NumPy and ``random``; a "new process" is this one with the module's state
cleared and every generator reseeded, as a restarted rank starts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from airflow_provider_torchdist import load_latest_checkpoint, rank_batches, save_checkpoint
from airflow_provider_torchdist.spark.data.batch_order import SHUFFLE_SEED_ENV
from airflow_provider_torchdist.spark.data.rank_data import DATA_DIR_ENV, shard_file
from airflow_provider_torchdist.spark.node import resume_position
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    RUN_ENV,
    SETTINGS_ENV,
    STORAGE_OPTIONS_ENV,
    Settings,
    step_dir,
)
from airflow_provider_torchdist.spark.node.checkpoint_manifest import run_env as run_env_value
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spark.node.resume_position import POSITIONS
from tests.object_store import S3Server

ROWS, BATCH, EPOCHS = 20, 4, 3  # 5 batches an epoch, 15 steps


def write_shard(directory: Path, rank: int, rows: int = ROWS) -> None:
    table = pa.table({"id": pa.array(range(rank * 1000, rank * 1000 + rows), pa.int64())})
    with pa.OSFile(str(shard_file(directory, rank)), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=7)


def new_process() -> None:
    """What a restarted rank starts with: no position, no resume point, generators seeded anew."""
    resume_position._current = None
    resume_position._resume = None
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)


@pytest.fixture
def run_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Rank 0 of 1, a seeded shard of 20 rows, and a checkpoint directory; returns the latter."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data, 0)
    write_shard(data, 1)
    for name, value in {
        DATA_DIR_ENV: str(data),
        SHUFFLE_SEED_ENV: "7",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "ckpt"))
    new_process()
    yield tmp_path / "ckpt"
    new_process()


def train(stop_at: int | None = None, batch_size: int = BATCH) -> list[tuple[Any, ...]]:
    """The loop a user writes: what each step saw (its rows and a draw of each generator)."""
    loaded = load_latest_checkpoint()
    step = loaded[0] if loaded else 0
    seen = []
    for epoch in range(EPOCHS):
        for batch in rank_batches(batch_size, epoch=epoch):
            draws = (torch.rand(1).item(), float(np.random.rand()), random.random())
            seen.append((step, epoch, batch["id"].tolist(), draws))
            step += 1
            save_checkpoint({"step": step}, step, keep=2)
            if step == stop_at:
                return seen
    return seen


def test_a_resumed_loop_trains_exactly_what_an_unstopped_one_does(run_env: Path, monkeypatch) -> None:
    whole = train()
    assert len(whole) == EPOCHS * ROWS // BATCH
    orders = [sorted(sum((ids for _, e, ids, _ in whole if e == epoch), [])) for epoch in range(EPOCHS)]
    assert orders == [list(range(ROWS))] * EPOCHS  # every row once an epoch
    epoch_rows = [[ids for _, e, ids, _ in whole if e == epoch] for epoch in range(EPOCHS)]
    assert epoch_rows[0] != epoch_rows[1] != epoch_rows[2]  # reshuffled each epoch

    monkeypatch.setenv(CHECKPOINT_ENV, str(run_env.parent / "stopped"))
    new_process()
    before = train(stop_at=7)  # mid-epoch 1: 5 of epoch 0, 2 of epoch 1
    new_process()
    after = train()
    assert before + after == whole
    assert after[0][:2] == (7, 1)


def test_a_position_saved_at_an_epochs_end_resumes_at_the_next(run_env: Path) -> None:
    train(stop_at=10)
    new_process()
    assert train()[0][:2] == (10, 2)


def test_retention_deletes_the_positions_of_the_checkpoints_it_deletes(run_env: Path) -> None:
    train(stop_at=6)
    assert sorted(p.name for p in (run_env / "positions").iterdir()) == [
        step_dir(5, None),
        step_dir(6, None),
    ]
    assert [p.name for p in (run_env / "positions" / step_dir(6, None)).iterdir()] == ["rank-0.json"]


def test_another_batch_size_starts_the_partial_epoch_over(run_env: Path, capfd) -> None:
    train(stop_at=7)
    new_process()
    after = train(batch_size=5)
    assert after[0][:2] == (7, 1)
    assert len([s for s in after if s[1] == 1]) == 4  # all of epoch 1, in batches of 5
    err = capfd.readouterr().err
    assert "epoch 1 starts over from its first batch: its position was saved with batch_size=4" in err


def two_ranks_saved(run_env: Path, monkeypatch, stop_at: int) -> None:
    """Ranks 0 and 1 of 2 trained ``stop_at`` steps and saved (each its own position)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    train(stop_at=stop_at)
    monkeypatch.setenv("RANK", "1")
    save_checkpoint({"step": stop_at}, stop_at)
    monkeypatch.setenv("RANK", "0")


def test_a_new_world_size_skips_the_epochs_done_and_starts_the_partial_one_over(
    run_env: Path, monkeypatch, capfd
) -> None:
    two_ranks_saved(run_env, monkeypatch, stop_at=7)
    new_process()
    monkeypatch.setenv("WORLD_SIZE", "1")
    after = train()
    assert after[0][:2] == (7, 1) and len(after) == 10  # epoch 1 whole, then epoch 2
    err = capfd.readouterr().err
    assert "world size changed from 2 to 1" in err and "epoch 1 starts over" in err


def test_a_rank_that_saved_no_position_makes_every_rank_start_the_epoch_over(
    run_env: Path, monkeypatch, capfd
) -> None:
    two_ranks_saved(run_env, monkeypatch, stop_at=7)
    (run_env / "positions" / step_dir(7, None) / "rank-1.json").unlink()
    new_process()
    assert len(train()) == 10
    assert "rank(s) [1] saved no data position at step 7" in capfd.readouterr().err


def tampered(body: dict[str, Any], change: str) -> bytes | dict[str, Any]:
    position, rng = body["position"], body["rng"]
    if change == "epoch-a-string":
        position["epoch"] = "1"
    elif change == "negative-batches":
        position["batches"] = -3
    elif change == "bool-as-count":
        position["batch_size"] = True
    elif change == "missing-field":
        del position["rows"]
    elif change == "giant-number":
        position["batches"] = 10**400
    elif change == "another-ranks-file":
        body["rank"] = 1
    elif change == "short-torch-state":
        rng["torch"] = rng["torch"][:100]
    elif change == "python-state-out-of-range":
        rng["python"]["internal"][0] = 2**40
    elif change == "deep-nesting":
        return b"[" * 200_000 + b"]" * 200_000
    elif change == "not-json":
        return b"\x80\x04\x95 a pickle, say"
    elif change == "huge-file":
        return json.dumps({**body, "pad": "x" * resume_position.MAX_POSITION_BYTES}).encode()
    return body


CHANGES = [
    "epoch-a-string",
    "negative-batches",
    "bool-as-count",
    "missing-field",
    "giant-number",
    "another-ranks-file",
    "short-torch-state",
    "python-state-out-of-range",
    "not-json",
    "deep-nesting",
    "huge-file",
]


@pytest.mark.parametrize("change", CHANGES)
def test_a_planted_or_broken_position_is_refused_with_one_line_and_nothing_is_skipped(
    run_env: Path, change: str, capfd
) -> None:
    train(stop_at=7)
    path = run_env / "positions" / step_dir(7, None) / "rank-0.json"
    body = tampered(json.loads(path.read_text()), change)
    path.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    new_process()
    capfd.readouterr()
    expected_draw = torch.rand(1).item()
    torch.manual_seed(1234)
    after = train()
    err = capfd.readouterr().err
    assert len(after) == 15  # today's: every epoch from its first batch
    assert after[0][3][0] == expected_draw  # the generators are left as they were
    lines = [line for line in err.splitlines() if "no exact resume" in line]
    assert len(lines) == 1 and "the data position saved at step 7 is refused" in lines[0], err
    if change == "huge-file":  # refused by its size, read no further than the bound
        assert "holds more than 262144 bytes" in lines[0]


def test_a_symlink_planted_as_the_positions_folder_is_not_written_through(
    run_env: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_env.mkdir()
    (run_env / "positions").symlink_to(elsewhere)
    with pytest.raises(OSError, match="not a directory of its own"):
        train(stop_at=1)
    assert list(elsewhere.iterdir()) == []


def test_on_s3_a_resume_is_exact_and_retention_deletes_the_positions(
    run_env: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    """The same on a real S3 server (moto's, over HTTP): each position one PUT, read back bounded."""
    whole = train()
    new_process()
    monkeypatch.setenv(CHECKPOINT_ENV, f"s3://{s3_server.bucket()}/ckpt")
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps(s3_server.storage_options))
    before = train(stop_at=8)
    new_process()
    assert before + train() == whole
    store = CheckpointStore.from_env()
    assert store is not None
    folders = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store._join(POSITIONS), detail=False))
    assert folders == [step_dir(14, None), step_dir(15, None)]


def test_another_dag_runs_checkpoint_restores_no_position(
    run_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume_from= another DAG run's checkpoint: its weights, not its place in data that may be
    other rows (a new day's); every epoch from its first batch."""
    monkeypatch.setenv(RUN_ENV, run_env_value("retrain", "scheduled__1", "train", -1, 1))
    train(stop_at=7)
    monkeypatch.setenv(RUN_ENV, run_env_value("retrain", "manual__2", "train", -1, 1))
    monkeypatch.setenv(SETTINGS_ENV, Settings(resume_from="latest").to_json())
    new_process()
    after = train()
    assert after[0][:2] == (7, 0) and len(after) == 15
