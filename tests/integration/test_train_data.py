"""train_data on the embedded master: bad data fails before any rank starts, a node that cannot
write its shard fails the run naming it, and a script reads its shard as a callable does.

The DAG-level test (``test_dags.py``, ``torchdist_e2e_train_data``) shows the shards themselves in
both modes; ``test_multihost.py`` shows them across two hosts with a driver smaller than the data.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import TrainingFailed
from airflow_provider_torchdist.spark.data.data_shards import ROUTE_CONF
from airflow_provider_torchdist.spark.data.shard_files import new_node_directory, remove_directory
from airflow_provider_torchdist.supervision.processes import is_alive

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("train_data")
    ids = list(range(1000))
    pq.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}), path / "part-0.parquet")
    return path


def must_not_run() -> None:
    """A training function that records that it ran (it must not, when the data is bad)."""
    Path(os.environ["RAN_MARKER"]).write_text("ran")


def not_a_dataframe(spark):
    return [1, 2, 3]


@pytest.mark.parametrize(
    "train_data, message",
    [
        ("db.missing", r"train_data failed before training: .*TABLE_OR_VIEW_NOT_FOUND"),
        ("SELECT nope FROM parquet.`{path}`", r"train_data failed before training: .*UNRESOLVED_COLUMN"),
        ("SELECT make_interval(1, 2) AS i", r"train_data failed before training: .*[Ii]nterval"),
        (not_a_dataframe, r"train_data's callable returned list, not a pyspark DataFrame"),
    ],
    ids=["missing-table", "bad-query", "interval-column", "callable-not-a-dataframe"],
)
def test_bad_train_data_fails_before_any_rank_starts(
    train_data, message: str, parquet_dir: Path, tmp_path: Path, no_leftovers: None
) -> None:
    marker = tmp_path / "ran"
    if isinstance(train_data, str):
        train_data = train_data.format(path=parquet_dir)
    hook = TorchDistributorHook(num_processes=2, train_data=train_data, rank_env={"RAN_MARKER": str(marker)})
    with pytest.raises(TrainingFailed, match=message):
        hook.run(must_not_run)
    assert not marker.exists()


@pytest.fixture
def small_tmp(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: the temp directory of the executors' Python workers in the next test. It holds
    the run's staging files (the package's zip alone is over 200 KiB) and its outcome, not the data."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk test needs root to mount a tmpfs (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def three_mb_of_parquet(tmp_path: Path) -> Path:
    """About 3 MB as Arrow: more than the 1 MiB tmpfs of the full-disk tests."""
    data = tmp_path / "data"
    data.mkdir()
    ids = list(range(200_000))
    pq.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}), data / "part-0.parquet")
    return data


def test_a_node_that_cannot_write_its_shard_fails_the_run_naming_it(
    tmp_path: Path, small_tmp: Path, no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shuffle's route (a cluster's; forced here): each node writes its ranks' files itself."""
    data = three_mb_of_parquet(tmp_path)
    marker = tmp_path / "ran"
    hook = TorchDistributorHook(
        num_processes=2,
        train_data=f"SELECT * FROM parquet.`{data}`",
        env_vars={"TMPDIR": str(small_tmp)},  # spark-submit's, and so its executors' Python workers'
        rank_env={"RAN_MARKER": str(marker)},
        conf={ROUTE_CONF: "shuffle"},
    )
    with pytest.raises(TrainingFailed) as raised:
        hook.run(must_not_run)
    message = str(raised.value)
    assert "a torchrun agent on" in message  # the node, by its host
    assert "cannot write this node's train_data shard into" in message
    assert "No space left on device" in message
    assert not marker.exists()
    # The partial shards are gone. A node removes its directory as its task ends; one that the
    # stage's cancellation killed first cannot, and the next node on this host removes a dead
    # task's directory (new_node_directory), as after any crash: that is what runs here then.
    deadline = time.monotonic() + 20
    while (left := list(small_tmp.iterdir())) and time.monotonic() < deadline:
        if all(not is_alive(int(path.name.split("-")[2])) for path in left):
            monkeypatch.setattr(tempfile, "tempdir", str(small_tmp))
            remove_directory(new_node_directory())
        time.sleep(0.2)
    assert list(small_tmp.iterdir()) == []


@pytest.mark.parametrize("local_mode", [False, True], ids=["distributed", "local"])
def test_pieces_that_do_not_fit_the_staging_disk_fail_before_training_naming_the_machine(
    tmp_path: Path, small_tmp: Path, no_leftovers: None, local_mode: bool
) -> None:
    """The embedded master's route: the tasks write the rows into the run's staging directory."""
    data = three_mb_of_parquet(tmp_path)
    marker = tmp_path / "ran"
    hook = TorchDistributorHook(
        num_processes=2,
        local_mode=local_mode,
        train_data=f"SELECT * FROM parquet.`{data}`",
        staging_dir=str(small_tmp),
        rank_env={"RAN_MARKER": str(marker)},
    )
    with pytest.raises(TrainingFailed) as raised:
        hook.run(must_not_run)
    message = str(raised.value)
    assert f"on {socket.gethostname()}: " in message
    assert f"cannot write a train_data piece into {small_tmp}" in message
    assert "No space left on device" in message
    assert not marker.exists()
    assert list(small_tmp.iterdir()) == []  # the staging directory, pieces and all, is gone


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from airflow_provider_torchdist import rank_shard

    dist.init_process_group("gloo")
    shard = rank_shard()
    out = os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json")
    with open(out, "w") as f:
        json.dump(shard.column("id").to_pylist(), f)
    dist.barrier()  # init_process_group has none: a rank leaving at once fails a slower peer's
    dist.destroy_process_group()
    """
)


def test_a_script_reads_its_shard_with_rank_shard(parquet_dir: Path, tmp_path: Path) -> None:
    """The query's ``:name`` parameters are bound by Spark from ``train_data_args`` (this run, shared
    to keep CI short, shows both): a value written to break out of a quoted literal stays a value.
    Spliced into the text, ``:probe`` would read ``'0' OR '1'='1'`` and select all 1000 rows."""
    import json

    script = tmp_path / "read_shard.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    hook = TorchDistributorHook(
        num_processes=2,
        train_data=f"SELECT id FROM parquet.`{parquet_dir}` WHERE id < :limit OR CAST(id AS STRING) = :probe",
        train_data_args={"limit": 600, "probe": "0' OR '1'='1"},
    )
    hook.run(str(script), str(out))
    shards = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [len(s) for s in shards] == [300, 300]
    assert sorted(shards[0] + shards[1]) == list(range(600))
