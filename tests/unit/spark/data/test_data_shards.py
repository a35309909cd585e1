"""train_data's plan and shard files: which rank gets which row, and what a node writes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from airflow_provider_torchdist.spark.data.rank_data import shard_file
from airflow_provider_torchdist.spark.data.shard_files import BlobPacker, ShardWriter
from airflow_provider_torchdist.spark.data.shard_plan import ShardPlan, TrainDataError, is_table_name


def _ranks(plan: ShardPlan) -> np.ndarray:
    return plan.ranks_of(np.arange(plan.total, dtype=np.int64))


@pytest.mark.parametrize("seed", [None, 0, 7, 123456789])
@pytest.mark.parametrize("counts", [(1001,), (500, 501), (0, 3, 998, 0), (7,) * 143])
def test_every_row_goes_to_one_rank_and_the_ranks_get_equal_shares(counts, seed) -> None:
    plan = ShardPlan(counts, world_size=4, seed=seed)
    ranks = _ranks(plan)
    assert plan.total == 1001
    assert plan.sizes == (250, 250, 250, 250) and plan.dropped == 1
    assert np.count_nonzero(ranks == -1) == 1  # one row dropped, no row twice
    assert np.bincount(ranks[ranks >= 0]).tolist() == [250] * 4


def test_the_shards_do_not_depend_on_the_partition_count() -> None:
    """The same rows in the same order, cut into 1, 3 or 143 partitions: the same shards."""
    shards = {
        counts: _ranks(ShardPlan(counts, 4, seed=11)).tolist()
        for counts in [(1001,), (300, 300, 401), (7,) * 143]
    }
    assert len({tuple(v) for v in shards.values()}) == 1


def test_a_partition_past_the_counted_ones_has_no_rows() -> None:
    """Over Spark Connect the counts stop at the last partition that holds rows."""
    plan = ShardPlan((3, 0, 5), world_size=2)
    assert plan.partition(0) == (0, 3)
    assert plan.partition(2) == (3, 5)
    assert plan.partition(3) == (8, 0) and plan.partition(9) == (8, 0)


def test_the_same_seed_deals_the_same_shards_and_another_seed_others() -> None:
    first, again, other = (_ranks(ShardPlan((1000,), 2, seed=s)) for s in (5, 5, 6))
    assert (first == again).all()
    assert not (first == other).all()
    assert not (first == _ranks(ShardPlan((1000,), 2))).all()  # shuffled, not the query's order
    assert (_ranks(ShardPlan((1000,), 2))[:500] == 0).all()  # no seed: contiguous runs


def test_keep_remainder_keeps_every_row_the_first_ranks_one_more() -> None:
    plan = ShardPlan((10,), world_size=4, keep_remainder=True)
    assert plan.sizes == (3, 3, 2, 2) and plan.dropped == 0
    assert _ranks(plan).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_fewer_rows_than_ranks_drops_them_all_unless_kept() -> None:
    assert ShardPlan((3,), world_size=4).sizes == (0, 0, 0, 0)
    assert ShardPlan((3,), world_size=4, keep_remainder=True).sizes == (1, 1, 1, 0)
    assert ShardPlan((), world_size=2).total == 0


def test_the_log_line_says_rows_ranks_and_what_was_dropped() -> None:
    assert ShardPlan((500, 501), 2).describe() == (
        "train_data: 1001 rows in 2 Spark partition(s) for 2 ranks, 500 rows each, dealt in the query's "
        "order; 1 row(s) dropped so that every rank has the same number (train_data_keep_remainder=True "
        "keeps them)"
    )
    assert "500 to 501 rows, dealt in the order of seed 3" in ShardPlan((1001,), 2, True, 3).describe()


@pytest.mark.parametrize(
    "text, table",
    [
        ("db.table", True),
        ("t", True),
        ("cat.db.t_1", True),
        ("`my db`.t", False),
        ("`db`.`t`", True),
        ("SELECT * FROM t", False),
        ("parquet.`/data/train`", False),
        ("a.b.c.d", False),
    ],
)
def test_a_bare_identifier_is_a_table_anything_else_a_query(text, table) -> None:
    assert is_table_name(text) is table


def _batch(ids: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"id": pa.array(ids, pa.int64()), "x": pa.array([float(i) for i in ids], pa.float32())}
    )


SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32())])


def test_blobs_carry_each_ranks_rows_to_its_file_joined_into_large_batches(tmp_path, monkeypatch) -> None:
    """What the computing tasks pack (small Spark batches, ranks mixed) is what the node writes."""
    packer = BlobPacker(blob_bytes=500)
    blobs = []
    for start in range(0, 300, 30):
        for rank in (2, 3):
            blobs += packer.add(rank, _batch([i for i in range(start, start + 30) if i % 2 == rank % 2]))
    blobs += packer.add(3, _batch([1000]))
    blobs += packer.flush()
    assert 4 < len(blobs) < 60  # several batches per blob

    monkeypatch.setattr(ShardWriter, "FLUSH_BYTES", 1000)
    writer = ShardWriter(tmp_path, range(2, 4), SCHEMA, {2: 150, 3: 151})
    for rank, blob in blobs:
        writer.add_ipc(rank, blob)
    writer.close()
    writer.check_complete()

    assert writer.rows == {2: 150, 3: 151}
    for rank, expected in ((2, list(range(0, 300, 2))), (3, [*range(1, 300, 2), 1000])):
        reader = pa.ipc.open_file(pa.memory_map(str(shard_file(tmp_path, rank))))
        table = reader.read_all()
        assert table.schema == SCHEMA
        assert table.column("id").to_pylist() == expected
        assert reader.num_record_batches < 10  # joined, not one per Spark batch


def test_a_blob_for_another_nodes_rank_is_refused(tmp_path) -> None:
    writer = ShardWriter(tmp_path, range(0, 2), SCHEMA)
    [(rank, blob)] = BlobPacker(1).add(5, _batch([1]))
    with pytest.raises(TrainDataError, match="rank 5 reached a node that holds ranks"):
        writer.add_ipc(rank, blob)
    writer.close()


def test_a_rank_that_got_other_than_the_planned_rows_fails_as_not_deterministic(tmp_path) -> None:
    writer = ShardWriter(tmp_path, [0], SCHEMA, {0: 2})
    for rank, blob in BlobPacker(1).add(0, _batch([1, 2, 3])):
        writer.add_ipc(rank, blob)
    writer.close()
    with pytest.raises(
        TrainDataError, match="not deterministic: rank\\(s\\) \\[0\\] got \\[3\\] rows, not the 2"
    ):
        writer.check_complete()


def test_a_rank_with_no_rows_still_gets_a_readable_file(tmp_path) -> None:
    schema = pa.schema([("id", pa.int64())])
    ShardWriter(tmp_path, [0], schema).close()
    assert pa.ipc.open_file(str(shard_file(tmp_path, 0))).read_all().num_rows == 0


def test_batches_whose_columns_spark_knows_are_never_null_fit_the_files_schema(tmp_path) -> None:
    """A filter on a column makes Spark's batches say it is not nullable; the file's schema (the
    query's) says it may be: the same data, written under the file's schema."""
    strict = pa.schema([pa.field("id", pa.int64(), nullable=False), ("x", pa.float32())])
    batch = pa.RecordBatch.from_arrays(
        [pa.array([1, 2], pa.int64()), pa.array([0.5, 1.5], pa.float32())], schema=strict
    )
    writer = ShardWriter(tmp_path, [0], SCHEMA, {0: 2})
    for rank, blob in BlobPacker(1).add(0, batch):
        writer.add_ipc(rank, blob)
    writer.close()
    writer.check_complete()
    assert pa.ipc.open_file(str(shard_file(tmp_path, 0))).read_all().schema == SCHEMA
