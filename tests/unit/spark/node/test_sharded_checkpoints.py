"""Sharded checkpoints (torch's DCP through the store) and asynchronous saves, in one process.

Real DCP writes and reads here (without a process group: one rank; two gloo processes where the
ranks must fail together); FSDP2 and resharding to another world size run on the netns cluster
(``tests/integration/test_worker_loss.py``) and in the example DAG (``dags/fsdp_training.py``). DCP unpickles its metadata and
its non-tensor values in full, and every executor can write the store, so the checks before DCP
reads are tested the way an attacker would plant a checkpoint: files and a manifest that match.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.spark.node import async_saves
from airflow_provider_torchdist.spark.node.checkpoint_manifest import MANIFEST, Manifest, step_dir
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spark.node.checkpoints import (
    CHECKPOINT_ENV,
    CheckpointNotAFile,
    CheckpointRefused,
    CheckpointSaveFailed,
    load_latest_checkpoint,
    save_checkpoint,
)
from airflow_provider_torchdist.spark.node.sharded_checkpoints import SHARDED_METADATA


class Planted:
    """What a compromised executor pickles: unpickling it opens (creates) the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


@pytest.fixture
def ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "ckpt"
    monkeypatch.setenv(CHECKPOINT_ENV, str(directory))
    monkeypatch.setenv("RANK", "0")
    yield directory
    with contextlib.suppress(CheckpointSaveFailed):  # none left in flight for the next test
        async_saves.wait_for_checkpoints()


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 8), value)}, "step": 3, "optim": {"param_groups": [{"lr": 0.1}]}}


def rewrite(directory: Path, step: int, name: str, data: bytes) -> None:
    """Replace one file of a committed checkpoint and its manifest's record: what anyone who can
    write the store can do (the hash proves integrity, not who wrote it)."""
    folder = directory / step_dir(step, None)
    (folder / name).write_bytes(data)
    manifest = Manifest.from_json((folder / MANIFEST).read_text())
    files = {**manifest.files, name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    (folder / MANIFEST).write_text(Manifest(**{**manifest.__dict__, "files": files}).to_json())


def test_a_sharded_save_commits_dcp_files_under_one_manifest_and_loads_back(ckpt_dir: Path) -> None:
    uri = save_checkpoint(state(2.0), 5, sharded=True, metrics={"loss": 0.5})
    folder = ckpt_dir / step_dir(5, None)
    assert uri == str(folder)
    manifest = CheckpointStore(str(ckpt_dir)).committed()[0]
    assert manifest.sharded and manifest.metrics == {"loss": 0.5}
    assert set(manifest.files) == {SHARDED_METADATA, "__0_0.distcp"}
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".staging")]  # staging removed

    target = state(0.0) | {"step": 0}
    step, loaded = load_latest_checkpoint(state=target)
    assert step == 5 and loaded is target
    assert torch.equal(target["model"]["w"], torch.full((64, 8), 2.0)) and target["step"] == 3


def test_a_sharded_checkpoint_needs_the_state_to_read_into(ckpt_dir: Path) -> None:
    save_checkpoint(state(1.0), 5, sharded=True)
    with pytest.raises(ValueError, match=r"sharded checkpoint: pass the state to read it into"):
        load_latest_checkpoint()


def test_a_planted_metadata_pickle_is_refused_and_nothing_in_it_runs(ckpt_dir: Path, tmp_path: Path) -> None:
    save_checkpoint(state(1.0), 5, sharded=True)
    marker = tmp_path / "pwned"
    rewrite(ckpt_dir, 5, SHARDED_METADATA, pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointRefused, match=r"its metadata is not DCP.s .io.open is not part"):
        load_latest_checkpoint(state=state(0.0))
    assert not marker.exists()


def _edited_metadata(ckpt_dir: Path, **change: object) -> bytes:
    """The committed checkpoint's DCP metadata with every entry's storage info changed."""
    metadata = pickle.loads(
        (ckpt_dir / step_dir(5, None) / SHARDED_METADATA).read_bytes()
    )  # the test's own file
    for info in metadata.storage_data.values():
        for key, value in change.items():
            setattr(info, key, value)
    return pickle.dumps(metadata)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"relative_path": "../../../../etc/passwd"}, "not one of its files"),
        ({"relative_path": MANIFEST}, "not one of its files"),
        ({"offset": 10**9}, "reads past the end"),
        ({"length": -1}, "not one of its files"),
        ({"transform_descriptors": ["zstandard"]}, "stream transforms"),
    ],
)
def test_metadata_that_reads_outside_its_files_is_refused(ckpt_dir: Path, change: dict, refusal: str) -> None:
    save_checkpoint(state(1.0), 5, sharded=True)
    rewrite(ckpt_dir, 5, SHARDED_METADATA, _edited_metadata(ckpt_dir, **change))
    with pytest.raises(CheckpointRefused, match=refusal):
        load_latest_checkpoint(state=state(0.0))


def test_a_planted_value_is_refused_before_dcp_unpickles_it(ckpt_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # What a compromised executor commits: DCP writes the value with torch.save, a full pickle.
    save_checkpoint({"w": torch.ones(2), "config": Planted(marker)}, 5, sharded=True, weights_only=False)
    assert not marker.exists()
    with pytest.raises(CheckpointRefused, match=r"it holds \[.io.open.\]"):
        load_latest_checkpoint(state={"w": torch.zeros(2), "config": None})
    assert not marker.exists()


def test_saving_a_value_the_load_would_refuse_fails_at_once_and_writes_nothing(ckpt_dir: Path) -> None:
    import numpy as np

    with pytest.raises(CheckpointRefused, match="save_checkpoint.step=5. refused"):
        save_checkpoint({"w": torch.ones(2), "mask": np.ones(3)}, 5, sharded=True)
    with pytest.raises(CheckpointRefused):
        save_checkpoint({"w": torch.ones(2), "mask": np.ones(3)}, 5, asynchronous=True)
    assert not ckpt_dir.exists() or not list(ckpt_dir.glob("step-*"))


def test_a_plain_state_is_refused_as_sharded_only_when_asked(ckpt_dir: Path) -> None:
    save_checkpoint(state(1.0), 5)
    assert not CheckpointStore(str(ckpt_dir)).committed()[0].sharded
    step, loaded = load_latest_checkpoint(state=state(0.0))  # a plain checkpoint: returned as loaded
    assert step == 5 and torch.equal(loaded["model"]["w"], torch.ones(64, 8))


@pytest.mark.parametrize("sharded", [False, True])
def test_an_async_save_returns_staged_and_commits_what_was_staged(ckpt_dir: Path, sharded: bool) -> None:
    live = state(1.0)
    uri = save_checkpoint(live, 7, asynchronous=True, sharded=sharded)
    live["model"]["w"].add_(100.0)  # training goes on at once: the checkpoint keeps the staged copy
    async_saves.wait_for_checkpoints()
    assert uri == str(ckpt_dir / step_dir(7, None))
    step, loaded = load_latest_checkpoint(state=state(0.0))
    assert step == 7 and torch.equal(loaded["model"]["w"], torch.full((64, 8), 1.0))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_failed_async_save_fails_the_next_save_naming_the_checkpoint(ckpt_dir: Path, sharded: bool) -> None:
    ckpt_dir.mkdir()
    os.symlink("/tmp", ckpt_dir / step_dir(7, None))  # the step's prefix is not a directory of ours
    save_checkpoint(state(1.0), 7, asynchronous=True, sharded=sharded)
    with pytest.raises(
        CheckpointSaveFailed,
        match=r"asynchronous save of checkpoint step 7 \(.*step-000000007-local\) failed",
    ) as failed:
        save_checkpoint(state(1.0), 8)
    assert isinstance(failed.value.__cause__, CheckpointNotAFile | OSError)
    assert [m.step for m in CheckpointStore(str(ckpt_dir)).committed()] == []
    async_saves.wait_for_checkpoints()  # reported once


def test_the_next_save_waits_for_the_one_in_flight(ckpt_dir: Path) -> None:
    release, order = threading.Event(), []
    async_saves.start(lambda: (release.wait(10), order.append("first")), 1, "first")
    waiter = threading.Thread(target=lambda: (save_checkpoint(state(1.0), 2), order.append("second")))
    waiter.start()
    waiter.join(0.5)
    assert order == [] and waiter.is_alive()
    release.set()
    waiter.join(10)
    assert order == ["first", "second"]


@pytest.mark.parametrize("sharded", [False, True])
def test_saves_that_reuse_the_staging_buffers_each_commit_their_own_state(
    ckpt_dir: Path, sharded: bool
) -> None:
    live = state(1.0)
    save_checkpoint(live, 1, asynchronous=True, sharded=sharded)
    live["model"]["w"].fill_(2.0)  # the next save stages into the same buffers, once the first is done
    save_checkpoint(live, 2, asynchronous=True, sharded=sharded)
    live["model"]["w"].fill_(3.0)
    async_saves.wait_for_checkpoints()
    store = CheckpointStore(str(ckpt_dir))
    for manifest in store.committed():
        if sharded:
            from airflow_provider_torchdist.spark.node.sharded_checkpoints import load_sharded

            loaded = load_sharded(store, manifest, state(0.0), None)
        else:
            loaded = torch.load(io.BytesIO(store.read_state(manifest)), weights_only=True)
        assert torch.equal(loaded["model"]["w"], torch.full((64, 8), float(manifest.step))), manifest.step


def test_a_link_planted_where_dcp_writes_in_the_store_is_never_written_through(
    ckpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An executor of another host that shares a local store sees a rank's staging directory appear
    # and plants a symlink at the name DCP writes (here, it wins that race every time). It can
    # reach the store only: a staging directory elsewhere is on the rank's own host.
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    made = CheckpointStore.staging_dir

    def raced(store: CheckpointStore) -> str:
        staging = made(store)
        if Path(staging).resolve().is_relative_to(ckpt_dir.resolve()):
            os.symlink(victim, os.path.join(staging, "__0_0.distcp"))
        return staging

    monkeypatch.setattr(CheckpointStore, "staging_dir", raced)
    save_checkpoint(state(1.0), 5, sharded=True)
    assert victim.read_bytes() == b"someone else's file"
    step, loaded = load_latest_checkpoint(state=state(0.0))
    assert step == 5 and torch.equal(loaded["model"]["w"], torch.ones(64, 8))


def test_shards_staged_on_another_filesystem_are_copied_into_place(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(ckpt_dir.parent).st_dev:
        pytest.skip("needs a temp dir on another filesystem than the store")
    with tempfile.TemporaryDirectory(dir=shm) as other:
        monkeypatch.setattr(tempfile, "tempdir", other)  # the staging dir's filesystem: not the store's
        save_checkpoint(state(2.0), 5, sharded=True)
        assert os.listdir(other) == []  # staging removed
        step, loaded = load_latest_checkpoint(state=state(0.0))
    assert step == 5 and torch.equal(loaded["model"]["w"], torch.full((64, 8), 2.0))


def _no_storage(m: object) -> None:
    m.storage_data = {}  # type: ignore[attr-defined]


def _chunk_past_the_end(m: object) -> None:
    m.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([2**62, 8])  # type: ignore[attr-defined]


def _odd_value(m: object) -> None:
    m.state_dict_metadata["model.w"] = Path("/etc/passwd")  # type: ignore[attr-defined]


def _odd_storage_meta(m: object) -> None:
    m.storage_meta = torch.Size([1])  # type: ignore[attr-defined]


@pytest.mark.parametrize("edit", [_no_storage, _chunk_past_the_end, _odd_value, _odd_storage_meta])
def test_metadata_of_allowed_classes_put_together_oddly_is_refused_by_name(ckpt_dir: Path, edit) -> None:
    # Only DCP's classes, so the unpickler takes it; DCP's planner would fail on it with a bare
    # KeyError or AttributeError (or read a chunk that does not fit its tensor).
    save_checkpoint(state(1.0), 5, sharded=True)
    metadata = pickle.loads((ckpt_dir / step_dir(5, None) / SHARDED_METADATA).read_bytes())  # the test's own
    edit(metadata)
    rewrite(ckpt_dir, 5, SHARDED_METADATA, pickle.dumps(metadata))
    with pytest.raises(
        CheckpointRefused, match=r"refused the sharded checkpoint .*step-000000005-local: its metadata"
    ):
        load_latest_checkpoint(state=state(0.0))


RANKS = """
import datetime, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, port, directory, out):
    os.environ.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["TORCHDIST_CHECKPOINT_DIR"] = directory
    dist.init_process_group("gloo", rank=r, world_size=2, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from airflow_provider_torchdist.spark.node.checkpoints import save_checkpoint
    mesh = init_device_mesh("cpu", (2,))
    try:
        save_checkpoint({"w": distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])}, 5)
        out.put((r, "saved"))
    except BaseException as exc:
        out.put((r, f"{type(exc).__name__}: {exc}"))

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    queue = mp.get_context("fork").SimpleQueue()
    mp.start_processes(rank, args=(port, sys.argv[1], queue), nprocs=2, start_method="fork")
    for r, outcome in sorted(queue.get() for _ in range(2)):
        print(r, outcome)
"""


def test_a_data_position_one_rank_cannot_write_fails_every_rank_of_a_sharded_save(tmp_path: Path) -> None:
    # What anyone who can write the store can plant: a directory at rank 1's position file. Rank 1
    # alone fails to write it; raising there alone would leave rank 0 in DCP's collectives until
    # rank 1's process is gone (or the group's timeout), then fail with gloo's "closed by peer".
    import subprocess
    import sys

    directory = tmp_path / "ckpt"
    (directory / "positions" / step_dir(5, None) / "rank-1.json").mkdir(parents=True)
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run(
        [sys.executable, str(script), str(directory)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert "failed, nothing committed: rank 1: IsADirectoryError" in line, line
    assert CheckpointStore(str(directory)).committed() == []


KILLED_MID_SAVE = """
import os, sys
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
staging = CheckpointStore(sys.argv[1]).staging_dir()
with open(os.path.join(staging, "__0_0.distcp"), "wb") as f:
    f.write(b"x" * 4096)  # a shard half written
print(staging, flush=True)
sys.stdin.read()  # until SIGKILLed: no finally runs
"""


def test_what_a_rank_killed_mid_save_staged_goes_with_the_next_save_and_restore_on_its_host(
    ckpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank SIGKILLed while it staged shards leaves them in the host's temp dir (a whole model's
    worth); the next sharded save on that host removes them, the next restore what a killed restore
    fetched, and neither leaves any of its own."""
    import subprocess
    import sys

    temp = tmp_path / "host-tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(ckpt_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    try:
        left = Path(killed.stdout.readline().strip())
    finally:
        killed.kill()
        killed.wait()
    assert left.parent == temp and (left / "__0_0.distcp").is_file()
    restoring = temp / f"torchdist-sharded-{killed.pid}-abc"  # one killed mid-restore
    restoring.mkdir()
    live = temp / f"torchdist-staging-{os.getppid()}-def"  # another rank's, still saving
    live.mkdir()

    save_checkpoint(state(2.0), 5, sharded=True)
    assert not left.exists() and live.is_dir()
    assert load_latest_checkpoint(state=state(0.0))[0] == 5
    assert not restoring.exists()
    assert sorted(p.name for p in temp.iterdir()) == [live.name]  # nothing of this process's left
