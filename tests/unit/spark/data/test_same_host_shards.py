"""``train_data`` when every task runs on the ranks' machine: pieces, the manifest, the seeded deal.

The Spark job that writes the pieces runs in the integration tests (``test_train_data.py``,
``test_dags.py``); here the pieces are written the way its tasks write them (``ShardWriter`` with
``files=``), and the driver's and the ranks' parts run on them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from airflow_provider_torchdist import rank_shard
from airflow_provider_torchdist.spark.data import data_shards
from airflow_provider_torchdist.spark.data.data_shards import (
    ROUTE_CONF,
    SHARED_DIR_CONF,
    remove_shards,
    shard_directory,
)
from airflow_provider_torchdist.spark.data.rank_data import DATA_DIR_ENV, MANIFEST, shard_file
from airflow_provider_torchdist.spark.data.same_host_shards import (
    deal_seeded,
    piece_name,
    same_host,
    slices,
)
from airflow_provider_torchdist.spark.data.shard_files import ShardWriter
from airflow_provider_torchdist.spark.data.shard_plan import ShardPlan, TrainDataError
from tests.unit.spark.data.test_rank_data import mapped_ranges

SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32())])


@pytest.mark.parametrize(
    "master, shared",
    [
        ("local", True),
        ("local[2]", True),
        ("local[*]", True),
        ("local[2,3]", True),
        ("local-cluster[2,1,1024]", True),
        ("spark://10.0.0.1:7077", False),
        ("yarn", False),
        ("k8s://https://api:6443", False),
        ("localhost:7077", False),
    ],
)
def test_only_a_local_master_runs_every_task_on_the_drivers_machine(master, shared) -> None:
    assert same_host(master) is shared


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self._values = values

    def get(self, key: str, default: str) -> str:
        return self._values.get(key, default)


class _Context:
    def __init__(self, master: str, conf: dict[str, str]) -> None:
        self.master = master
        self._conf = _Conf(conf)

    def getConf(self) -> _Conf:  # noqa: N802 (SparkContext's name)
        return self._conf


def test_the_route_setting_can_force_the_shuffle_and_refuses_anything_else(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    assert shard_directory(_Context("local[2]", {}), staging, "r1") == staging / "data"
    assert shard_directory(_Context("local[2]", {ROUTE_CONF: "shuffle"}), staging, "r1") is None
    assert shard_directory(_Context("spark://h:7077", {ROUTE_CONF: "auto"}), staging, "r1") is None
    with pytest.raises(TrainDataError, match=r"spark.torchdist.trainData.route must be 'auto' or 'shuffle'"):
        shard_directory(_Context("local[2]", {ROUTE_CONF: "files"}), staging, "r1")


def test_a_cluster_whose_nodes_mount_a_shared_directory_gets_the_rows_there(tmp_path: Path) -> None:
    """The connection's ``shared-dir`` (this Spark setting): a run directory of its own in it, unless
    every task runs here anyway (the staging directory) or the shuffle is asked for."""
    staging, shared = tmp_path / "staging", tmp_path / "shared"
    shared.mkdir()
    cluster = {SHARED_DIR_CONF: f" {shared} "}
    assert shard_directory(_Context("spark://h:7077", cluster), staging, "r1") == shared / "torchdist-rows-r1"
    assert shard_directory(_Context("local[2]", cluster), staging, "r1") == staging / "data"
    assert (
        shard_directory(_Context("spark://h:7077", {**cluster, ROUTE_CONF: "shuffle"}), staging, "r1") is None
    )
    for bad, why in (("relative/dir", "not absolute"), (str(tmp_path / "missing"), "not a directory here")):
        with pytest.raises(
            TrainDataError, match=f"trainData.sharedDir must be a directory .*; '{bad}' is {why}"
        ):
            shard_directory(_Context("spark://h:7077", {SHARED_DIR_CONF: bad}), staging, "r1")
    # After the run: the run directory in the shared one goes; the staging directory's is left to
    # the staging directory's owner, and the shuffle's DataFrame is nothing to remove.
    run_dir = shared / "torchdist-rows-r1"
    (run_dir / "piece").parent.mkdir()
    (run_dir / "piece").write_bytes(b"rows")
    (staging / "data").mkdir(parents=True)
    remove_shards(staging / "data", staging)
    remove_shards(object(), staging)
    remove_shards(run_dir, staging)
    assert (staging / "data").is_dir() and not run_dir.exists() and shared.is_dir()


def test_the_runs_shared_directory_is_its_own_and_a_failed_run_leaves_nothing_there(
    tmp_path, monkeypatch
) -> None:
    """Made new (0700) for the run: one that exists already (another user's, on a shared disk) is
    refused and left alone; a run whose tasks fail removes what they wrote."""
    staging, shared = tmp_path / "staging", tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr(data_shards, "build_dataframe", lambda spark, spec, staging: "df")
    monkeypatch.setattr(data_shards, "arrow_schema", lambda df: SCHEMA)

    def fails(df, spec, schema, directory, say):
        (directory / "piece-000000-0.arrow").write_bytes(b"rows")
        raise RuntimeError("Job aborted: a task failed")

    monkeypatch.setattr(data_shards, "same_host_shards", fails)
    run_dir = shared / "torchdist-rows-r1"
    with pytest.raises(TrainDataError, match="train_data failed before training: Job aborted"):
        data_shards.on_shared_disk(None, None, staging, run_dir, print)
    assert list(shared.iterdir()) == []
    theirs = shared / "torchdist-rows-r2"
    theirs.mkdir()
    (theirs / "planted").write_text("x")
    with pytest.raises(TrainDataError, match="cannot make the run's train_data directory .*File exists"):
        data_shards.on_shared_disk(None, None, staging, theirs, print)
    assert (theirs / "planted").exists()
    monkeypatch.setattr(data_shards, "same_host_shards", lambda df, spec, schema, directory, say: directory)
    assert data_shards.on_shared_disk(None, None, staging, run_dir, print) == run_dir
    assert run_dir.stat().st_mode & 0o777 == 0o700


def _pieces(directory: Path, counts: list[int]) -> list[tuple[int, int, str]]:
    """Write one piece per partition (ids in the query's order, batches of 3 rows), as the tasks do."""
    pieces, next_id = [], 0
    for partition, rows in enumerate(counts):
        if rows:
            writer = ShardWriter(
                directory, [], SCHEMA, files={partition: str(directory / piece_name(partition))}
            )
            for start in range(0, rows, 3):
                ids = np.arange(next_id + start, next_id + min(start + 3, rows), dtype=np.int64)
                writer.add(
                    partition,
                    pa.RecordBatch.from_arrays(
                        [pa.array(ids), pa.array(ids * 0.5, pa.float32())], schema=SCHEMA
                    ),
                )
            writer.close()
        pieces.append((partition, rows, piece_name(partition) if rows else ""))
        next_id += rows
    return pieces


def test_without_a_seed_each_rank_gets_contiguous_slices_of_the_pieces_in_the_querys_order() -> None:
    rng = random.Random(3)
    for _ in range(500):
        counts = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(rng.randint(1, 9))]
        plan = ShardPlan(tuple(counts), rng.randint(1, 6), keep_remainder=rng.random() < 0.5)
        pieces = [(p, n, f"piece-{p}") for p, n in enumerate(counts)]
        ranks = plan.ranks_of(np.arange(plan.total, dtype=np.int64))
        for rank, runs in slices(plan, pieces).items():
            got = [
                plan.offsets[int(name.split("-")[1])] + first + i for name, first, n in runs for i in range(n)
            ]
            assert got == np.flatnonzero(ranks == rank).tolist(), (counts, plan.world_size, rank)


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def become(rank: int) -> None:
        monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
        monkeypatch.setenv("RANK", str(rank))

    return become


def test_a_rank_maps_its_slices_of_the_pieces_through_the_manifest(tmp_path, as_rank) -> None:
    counts = [10, 0, 7, 4]  # 21 rows, 2 ranks: 10 each, the last row dropped
    pieces = _pieces(tmp_path, counts)
    plan = ShardPlan(tuple(counts), 2)
    runs = slices(plan, pieces)
    (tmp_path / MANIFEST).write_text(json.dumps({"ranks": {str(r): v for r, v in runs.items()}}))
    shards = {}
    for rank in (0, 1):
        as_rank(rank)
        shards[rank] = rank_shard()
    assert shards[0].column("id").to_pylist() == list(range(10))
    assert shards[1].column("id").to_pylist() == list(range(10, 20))
    assert shards[1].schema == SCHEMA
    # Mapped, not read: every buffer lies in a mapping of a piece file, none in the rank's memory.
    ranges = [r for name in (piece_name(2), piece_name(3)) for r in mapped_ranges(tmp_path / name)]
    for chunk in shards[1].column("id").chunks:
        address = chunk.buffers()[1].address
        assert any(a <= address < b for a, b in ranges)


def test_a_rank_with_a_file_of_its_own_reads_it_rather_than_the_manifest(tmp_path, as_rank) -> None:
    pieces = _pieces(tmp_path, [2])
    plan = ShardPlan((2,), 3, keep_remainder=True)  # rank 2 has no rows
    runs = slices(plan, pieces)
    ShardWriter(tmp_path, [r for r, v in runs.items() if not v], SCHEMA).close()
    (tmp_path / MANIFEST).write_text(json.dumps({"ranks": {str(r): v for r, v in runs.items() if v}}))
    as_rank(2)
    empty = rank_shard()
    assert empty.num_rows == 0 and empty.schema == SCHEMA
    as_rank(1)
    assert rank_shard().column("id").to_pylist() == [1]


@pytest.mark.parametrize("seed", [0, 7])
def test_with_a_seed_the_pieces_are_dealt_into_rank_files_and_then_removed(tmp_path, as_rank, seed) -> None:
    counts = [10, 0, 7, 4]
    pieces = _pieces(tmp_path, counts)
    plan = ShardPlan(tuple(counts), 2, seed=seed)
    deal_seeded(plan, pieces, SCHEMA, tmp_path)
    assert not list(tmp_path.glob("piece-*"))
    ranks = plan.ranks_of(np.arange(plan.total, dtype=np.int64))
    seen = []
    for rank in (0, 1):
        assert shard_file(tmp_path, rank).is_file()
        as_rank(rank)
        ids = rank_shard().column("id").to_pylist()
        assert sorted(ids) == np.flatnonzero(ranks == rank).tolist()
        seen += ids
    assert len(seen) == len(set(seen)) == 20
