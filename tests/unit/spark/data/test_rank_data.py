"""The rank side of ``train_data=``: ``rank_shard`` and ``rank_batches`` over an Arrow IPC file.

Each test writes ``rank-<RANK>.arrow`` as the driver's stage does (``pyarrow.ipc.new_file``, several
record batches) into ``tmp_path`` and points ``TORCHDIST_DATA_DIR`` and ``RANK`` at it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from airflow_provider_torchdist import rank_batches, rank_shard
from airflow_provider_torchdist.spark.data.batch_order import SHUFFLE_SEED_ENV
from airflow_provider_torchdist.spark.data.rank_data import DATA_DIR_ENV, data_environment, shard_file


def write_shard(directory: Path, rank: int, batches: list[dict[str, pa.Array]]) -> Path:
    """Write one record batch per dict, as the Spark stage writes a rank's shard."""
    path = shard_file(directory, rank)
    record_batches = [pa.RecordBatch.from_pydict(b) for b in batches]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, record_batches[0].schema) as writer:
        for batch in record_batches:
            writer.write_batch(batch)
    return path


def numeric_batch(start: int, n: int) -> dict[str, pa.Array]:
    ids = np.arange(start, start + n, dtype=np.int64)
    features = (ids[:, None] * 10 + np.arange(4)).astype(np.float32)
    return {
        "id": pa.array(ids),
        "x": pa.array(ids.astype(np.float32) / 2),
        "flag": pa.array(ids % 3 == 0),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 4),
    }


@pytest.fixture
def shard_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory with rank 1's shard of 25 rows in record batches of 10, 10 and 5."""
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    write_shard(tmp_path, 1, [numeric_batch(0, 10), numeric_batch(10, 10), numeric_batch(20, 5)])
    write_shard(tmp_path, 0, [numeric_batch(100, 3)])  # another rank's: never read by rank 1
    return tmp_path


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps ``path`` at (``/proc/self/maps``)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def in_mapping(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    lo = tensor.data_ptr()
    hi = lo + tensor.numel() * tensor.element_size()
    return any(a <= lo and hi <= b for a, b in ranges)


def test_rank_shard_is_this_ranks_rows_memory_mapped(shard_dir: Path) -> None:
    table = rank_shard()
    assert table.num_rows == 25
    assert table.column_names == ["id", "x", "flag", "features"]
    assert table.column("id").to_pylist() == list(range(25))
    ranges = mapped_ranges(shard_file(shard_dir, 1))
    assert ranges, "the shard file is memory-mapped, not read"
    address = table.column("id").chunks[0].buffers()[1].address
    assert any(a <= address < b for a, b in ranges)


def test_batches_hold_the_shards_values(shard_dir: Path) -> None:
    batches = list(rank_batches(7))
    assert [len(b["id"]) for b in batches] == [7, 7, 7, 4]
    ids = torch.cat([b["id"] for b in batches])
    assert ids.tolist() == list(range(25))
    assert ids.dtype == torch.int64
    x = torch.cat([b["x"] for b in batches])
    assert x.dtype == torch.float32 and torch.equal(x, torch.arange(25, dtype=torch.float32) / 2)
    flag = torch.cat([b["flag"] for b in batches])
    assert flag.dtype == torch.bool and flag.tolist() == [i % 3 == 0 for i in range(25)]


def test_fixed_size_lists_become_2d_tensors(shard_dir: Path) -> None:
    (batch,) = rank_batches(25, columns=["features"])
    features = batch["features"]
    assert features.shape == (25, 4) and features.dtype == torch.float32
    expected = (torch.arange(25)[:, None] * 10 + torch.arange(4)).float()
    assert torch.equal(features, expected)


def test_a_batch_within_one_record_batch_is_a_view_of_the_map(shard_dir: Path) -> None:
    """Rows 2..6 lie in the first record batch: no copy, for scalar and fixed-size list columns."""
    batches = rank_batches(5, columns=["id", "x", "features"])
    next(batches)
    second = next(batches)
    assert second["id"].tolist() == [5, 6, 7, 8, 9]
    ranges = mapped_ranges(shard_file(shard_dir, 1))
    for name in ("id", "x", "features"):
        assert in_mapping(second[name], ranges), f"{name} was copied"
    assert torch.equal(second["features"][0], torch.tensor([50.0, 51.0, 52.0, 53.0]))


def test_a_batch_across_record_batches_is_concatenated(shard_dir: Path) -> None:
    batches = list(rank_batches(8, columns=["id", "features"]))
    spanning = batches[1]  # rows 8..15: the first record batch's last 2, the second's first 6
    assert spanning["id"].tolist() == list(range(8, 16))
    assert spanning["features"].shape == (8, 4)
    assert spanning["features"][:, 0].tolist() == [i * 10.0 for i in range(8, 16)]
    ranges = mapped_ranges(shard_file(shard_dir, 1))
    assert not in_mapping(spanning["id"], ranges)
    assert in_mapping(batches[0]["id"], ranges)


def test_drop_last_drops_the_short_batch(shard_dir: Path) -> None:
    assert [len(b["id"]) for b in rank_batches(10, drop_last=True)] == [10, 10]
    assert [len(b["id"]) for b in rank_batches(5, drop_last=True)] == [5, 5, 5, 5, 5]
    assert list(rank_batches(30, drop_last=True)) == []


def test_columns_pick_and_order_the_tensors(shard_dir: Path) -> None:
    (batch,) = rank_batches(100, columns=["x", "id"])
    assert list(batch) == ["x", "id"]


def test_views_are_handed_out_without_torchs_read_only_warning(shard_dir: Path) -> None:
    """torch warns once per process about a read-only array: with warnings as errors, our views
    do not raise it (a fresh interpreter, since an earlier conversion in this one has used it up)."""
    code = """
import warnings
warnings.simplefilter("error")
from airflow_provider_torchdist import rank_batches
batch = next(rank_batches(5))
assert batch["id"].tolist() == [0, 1, 2, 3, 4]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("column", "type_name"),
    [
        (pa.array(["a", "b"]), "string"),
        (
            pa.array([[[1.0]], [[2.0]]], type=pa.list_(pa.list_(pa.float32()))),
            "list<item: list<item: float>>",
        ),
        (pa.array([{"a": 1}, {"a": 2}]), "struct<a: int64>"),
        (pa.array([1, 2], type=pa.date32()), "date32[day]"),
        (
            pa.array([["a", "b"], ["c", "d"]], type=pa.list_(pa.string(), 2)),
            "fixed_size_list<item: string>[2]",
        ),
    ],
)
def test_columns_no_tensor_can_hold_are_refused_by_name_and_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, column: pa.Array, type_name: str
) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    write_shard(tmp_path, 0, [{"id": pa.array([1, 2]), "bad": column}])
    with pytest.raises(TypeError, match=re.escape(f"column 'bad' has type {type_name},")):
        rank_batches(2)
    assert next(rank_batches(2, columns=["id"]))["id"].tolist() == [1, 2]  # the others still work


def test_nulls_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    values = pa.array([1.0, None, 2.0, 3.0], type=pa.float32())
    write_shard(
        tmp_path,
        0,
        [
            {
                "x": pa.array([1.0, None], type=pa.float64()),
                "v": pa.FixedSizeListArray.from_arrays(values, 2),
                "ok": pa.array([1, 2]),
            }
        ],
    )
    with pytest.raises(TypeError, match=r"column 'x' \(double\) holds 1 null"):
        rank_batches(2, columns=["x"])
    with pytest.raises(TypeError, match=r"column 'v' .* holds 1 null"):
        rank_batches(2, columns=["v"])
    assert next(rank_batches(2, columns=["ok"]))["ok"].tolist() == [1, 2]


def test_unknown_columns_are_named_with_the_available_ones(shard_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown column\(s\) \['nope'\].*\['id', 'x', 'flag', 'features'\]"
    ):
        rank_batches(4, columns=["id", "nope"])
    with pytest.raises(TypeError, match="list of column names"):
        rank_batches(4, columns="id")


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "8", True, None])
def test_a_bad_batch_size_is_refused(shard_dir: Path, batch_size: object) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        rank_batches(batch_size)  # type: ignore[arg-type]


def test_a_run_without_train_data_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        RuntimeError, match=r"this run has no train_data: pass train_data=\.\.\. to the operator"
    ):
        rank_shard()
    with pytest.raises(RuntimeError, match="this run has no train_data"):
        rank_batches(8)


def test_a_missing_shard_file_names_the_rank_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(RuntimeError, match=r"rank 3 has no shard: .*rank-3\.arrow does not exist"):
        rank_shard()


def test_outside_a_rank_rank_is_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set"):
        rank_shard()


def test_an_empty_shard_yields_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    write_shard(tmp_path, 0, [{"id": pa.array([], type=pa.int64())}])
    assert rank_shard().num_rows == 0
    assert list(rank_batches(4)) == []


def test_every_numeric_type_keeps_its_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    types = {
        "i8": (pa.int8(), torch.int8),
        "i16": (pa.int16(), torch.int16),
        "i32": (pa.int32(), torch.int32),
        "u8": (pa.uint8(), torch.uint8),
        "f16": (pa.float16(), torch.float16),
        "f64": (pa.float64(), torch.float64),
    }
    columns = {}
    for name, (arrow_type, _) in types.items():
        values = np.array([1, 2, 3]).astype(arrow_type.to_pandas_dtype())
        columns[name] = pa.array(values, type=arrow_type)
    write_shard(tmp_path, 0, [columns])
    (batch,) = rank_batches(3)
    for name, (_, dtype) in types.items():
        assert batch[name].dtype == dtype and batch[name].tolist() == [1, 2, 3], name


def test_lists_of_one_length_become_2d_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark's array<float> arrives as a variable-length list: a 2-D tensor when all rows agree."""
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    first = [[float(i), float(i) + 0.5, -float(i)] for i in range(6)]
    second = [[float(i), float(i) + 0.5, -float(i)] for i in range(6, 9)]
    list_type = pa.list_(pa.float32())
    write_shard(
        tmp_path, 0, [{"v": pa.array(first, type=list_type)}, {"v": pa.array(second, type=list_type)}]
    )
    batches = list(rank_batches(4))
    assert [tuple(b["v"].shape) for b in batches] == [(4, 3), (4, 3), (1, 3)]
    assert torch.cat([b["v"] for b in batches]).tolist() == first + second
    assert in_mapping(batches[0]["v"], mapped_ranges(shard_file(tmp_path, 0)))


def test_lists_of_different_lengths_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    write_shard(tmp_path, 0, [{"v": pa.array([[1.0], [2.0, 3.0]], type=pa.list_(pa.float32()))}])
    with pytest.raises(
        TypeError, match=r"column 'v' \(list<item: float>\) holds lists of different lengths \(1, 2\)"
    ):
        rank_batches(2)


def epoch_ids(epoch: int, **kwargs: Any) -> list[list[int]]:
    return [b["id"].tolist() for b in rank_batches(4, columns=["id", "features"], epoch=epoch, **kwargs)]


def test_each_epoch_is_reshuffled_from_the_seed_and_the_epoch(
    shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``epoch=e`` with ``train_data_shuffle_seed``: every row once an epoch, an order of its own
    each epoch, the same for the same (seed, epoch, rank) in another process or try."""
    monkeypatch.setenv(SHUFFLE_SEED_ENV, "7")
    epochs = [epoch_ids(e) for e in range(3)]
    for batches in epochs:
        assert [len(b) for b in batches] == [4] * 6 + [1]
        assert sorted(sum(batches, [])) == list(range(25))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epoch_ids(1) == epochs[1]  # deterministic
    assert epoch_ids(1, drop_last=True) == epochs[1][:6]
    monkeypatch.setenv(SHUFFLE_SEED_ENV, "8")
    assert epoch_ids(1) != epochs[1]
    monkeypatch.setenv("RANK", "0")  # another rank's order is its own (rank 0's shard has 3 rows)
    assert sorted(sum(epoch_ids(0), [])) == [100, 101, 102]


def test_a_shuffled_batch_is_a_copy_of_its_rows_and_matches_them(
    shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHUFFLE_SEED_ENV, "3")
    mapped = mapped_ranges(shard_file(shard_dir, 1))
    for batch in rank_batches(4, epoch=0):
        assert not in_mapping(batch["features"], mapped)
        ids = batch["id"]
        assert batch["features"].tolist() == [[i * 10 + k for k in range(4)] for i in ids.tolist()]
        assert batch["flag"].tolist() == [i % 3 == 0 for i in ids.tolist()]


def test_without_a_seed_every_epoch_is_in_order(shard_dir: Path) -> None:
    assert epoch_ids(0) == epoch_ids(2) == [list(range(s, min(s + 4, 25))) for s in range(0, 25, 4)]


@pytest.mark.parametrize("epoch", [-1, 1.0, True, "0"])
def test_an_epoch_that_is_not_an_int_from_0_is_refused(shard_dir: Path, epoch: Any) -> None:
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0 \(the loop's epoch number\), got"):
        rank_batches(4, epoch=epoch)


def test_the_task_seed_reaches_the_ranks_beside_their_data_directory() -> None:
    assert data_environment("/d", 5) == {DATA_DIR_ENV: "/d", SHUFFLE_SEED_ENV: "5"}
    assert data_environment("/d", 0) == {DATA_DIR_ENV: "/d", SHUFFLE_SEED_ENV: "0"}
    assert data_environment("/d", None) == {DATA_DIR_ENV: "/d"}
