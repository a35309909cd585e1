"""The checkpoint store's commit protocol, on a local directory and on a real S3 server (moto's,
a separate process reached over HTTP by s3fs): a reader trusts only steps whose manifest was
written, and only files that match it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.spark.node.checkpoint_files import CheckpointNotAFile
from airflow_provider_torchdist.spark.node.checkpoint_manifest import MANIFEST, STATE, Manifest, step_dir
from airflow_provider_torchdist.spark.node.checkpoint_store import (
    MAX_MANIFEST_BYTES,
    CheckpointStore,
    CheckpointStoreError,
)
from tests.object_store import S3Server

RUN = {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1}


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ckpt"))
    server: S3Server = request.getfixturevalue("s3_server")
    return CheckpointStore(f"s3://{server.bucket()}/runs/ckpt", server.storage_options)


def test_committed_steps_round_trip_and_delete(store: CheckpointStore) -> None:
    assert store.committed() == []
    store.probe()
    first = store.commit(Manifest(step=10, time=1.0, metrics={"val_loss": 0.5}, run=RUN), b"state-10")
    second = store.commit(Manifest(step=20, time=2.0, run=RUN), b"state-20")
    assert sorted(m.step for m in store.committed()) == [10, 20]
    assert store.read_state(first) == b"state-10"
    assert store.uri_of(first) == f"{store.uri}/{step_dir(10, RUN)}"
    store.delete(first)
    assert store.committed() == [second]


def test_a_step_whose_manifest_was_never_written_is_not_trusted(store: CheckpointStore) -> None:
    """A writer killed between its files and its manifest leaves files no reader loads: the
    step's state is there (whole or torn), its manifest is not."""
    store.commit(Manifest(step=1, time=1.0, run=RUN), b"good")
    plant(store, step_dir(2, RUN), STATE, b"half a stat")
    assert [m.step for m in store.committed()] == [1]


def plant(store: CheckpointStore, step: str, name: str, data: bytes) -> None:
    """Another writer puts ``data`` at ``<step>/<name>`` (bypassing the commit protocol)."""
    if store.fs is None:
        os.makedirs(store._join(step), exist_ok=True)
    store._write(store._join(step, name), data)


def test_a_state_changed_after_its_commit_is_refused(store: CheckpointStore) -> None:
    manifest = store.commit(Manifest(step=3, time=1.0, run=RUN), b"the real state")
    plant(store, step_dir(3, RUN), STATE, b"someone else's state")
    with pytest.raises(CheckpointStoreError, match="does not match its manifest"):
        store.read_state(manifest)


def test_a_manifest_copied_to_another_step_is_not_trusted(store: CheckpointStore) -> None:
    manifest = store.commit(Manifest(step=3, time=1.0, run=RUN), b"state")
    plant(store, step_dir(99, RUN), MANIFEST, manifest.to_json().encode())
    assert [m.step for m in store.committed()] == [3]


def test_local_symlinks_planted_in_the_directory_are_never_followed(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    manifest = store.commit(Manifest(step=1, time=1.0, run=RUN), b"state")
    victim = tmp_path / "victim"
    victim.write_bytes(b"state")  # same bytes: only the refusal to follow stops the read
    state = Path(store._join(step_dir(1, RUN), STATE))
    state.unlink()
    state.symlink_to(victim)
    with pytest.raises(CheckpointNotAFile, match="a symlink"):
        store.read_state(manifest)
    outside = tmp_path / "outside"
    outside.mkdir()
    Path(store._join(step_dir(2, RUN))).symlink_to(outside)
    with pytest.raises(CheckpointNotAFile, match="not a directory of its own"):
        store.commit(Manifest(step=2, time=2.0, run=RUN), b"state")
    assert list(outside.iterdir()) == []


def test_a_store_that_cannot_be_written_fails_its_probe(s3_server: S3Server) -> None:
    with pytest.raises(Exception, match="(?i)bucket"):
        CheckpointStore("s3://no-such-bucket-here/ckpt", s3_server.storage_options).probe()


@pytest.mark.parametrize(
    "forged",
    [
        {"metrics": [1.0]},  # not a mapping: AttributeError in every reader before
        {"step": "Infinity"},  # json.loads makes inf, int(inf) raised OverflowError
        {"files": {STATE: "not a dict"}},
        {"metrics": {"val_loss": "NaN"}},
        {"time": "Infinity"},
        {"run": ["not", "a", "dict"]},
        {"finished": "yes"},
        {"files": {"../../victim": {"bytes": 1, "sha256": "0"}}},  # a path, not a file's name
        {"files": {"sub/state.pt": {"bytes": 1, "sha256": "0"}}},
        {"files": {".hidden": {"bytes": 1, "sha256": "0"}}},
        {"metrics": {"val_loss": 10**400}},  # an int beyond any float: math.isfinite raised OverflowError
        {"time": 10**400},
    ],
)
def test_a_manifest_of_wrong_types_is_not_trusted_and_breaks_no_reader(
    store: CheckpointStore, forged: dict[str, str | object]
) -> None:
    """Whoever can write the store plants one manifest of the wrong shape at a step of its own:
    it is not a committed checkpoint, and every other run sharing the directory still lists its
    own (before, one such object made ``committed()`` raise in every rank and task)."""
    honest = store.commit(Manifest(step=1, time=1.0, run=RUN), b"state")
    fields = {"format": "torchdist-checkpoint/1", "step": 7, "time": 1.0, "run": None, **forged}
    text = json.dumps(fields).replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
    plant(store, step_dir(7, None), MANIFEST, text.encode())
    assert store.committed() == [honest]


def test_a_deeply_nested_manifest_is_not_trusted_and_breaks_no_reader(store: CheckpointStore) -> None:
    """A planted manifest well under the size cap but nested 100,000 deep made ``json.loads`` raise
    ``RecursionError`` in every rank and task that listed the store."""
    honest = store.commit(Manifest(step=1, time=1.0, run=RUN), b"state")
    nested = '{"format": "torchdist-checkpoint/1", "step": 7, "time": 1.0, "run": {"x": '
    plant(store, step_dir(7, None), MANIFEST, (nested + "[" * 100_000 + "]" * 100_000 + "}}").encode())
    assert store.committed() == [honest]


def test_a_huge_manifest_is_not_read_whole(store: CheckpointStore) -> None:
    """A planted manifest of many megabytes (a sparse file costs nothing locally) is refused
    after a bounded read, not read into every rank's and the task's memory."""
    honest = store.commit(Manifest(step=1, time=1.0, run=RUN), b"state")
    padded = Manifest(step=7, time=1.0).to_json()[:-1] + " " * (4 * MAX_MANIFEST_BYTES) + "}"
    plant(store, step_dir(7, None), MANIFEST, padded.encode())
    assert store.committed() == [honest]


def test_a_step_directory_planted_as_a_symlink_is_not_trusted(tmp_path: Path) -> None:
    """A symlink at a step's name would make reads, the task's ``finished`` rewrite and
    retention's deletes act in the directory it points to: it is no committed checkpoint."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    honest = store.commit(Manifest(step=1, time=1.0, run=RUN), b"state")
    elsewhere = CheckpointStore(str(tmp_path / "elsewhere"))
    other = elsewhere.commit(Manifest(step=2, time=2.0, run=RUN), b"someone else's")
    Path(store._join(step_dir(2, RUN))).symlink_to(elsewhere._join(step_dir(2, RUN)))
    assert store.committed(RUN) == [honest]
    assert elsewhere.committed(RUN) == [other]


def test_retention_never_deletes_through_a_step_swapped_for_a_symlink_after_it_was_listed(
    tmp_path: Path,
) -> None:
    """Anyone who can write the store plants a checkpoint of this run whose manifest names files
    of a victim directory, lets retention list it, then swaps the step for a symlink to the
    victim: the delete that follows must not reach through it (before, it unlinked every file
    the manifest named there)."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("authorized_keys", STATE, MANIFEST):
        (victim / name).write_text("keep me")
    planted = store.commit(Manifest(step=1, time=1.0, run=RUN), {"authorized_keys": b"x"})
    [listed] = store.committed(RUN)  # retention's listing
    step = Path(store._join(step_dir(1, RUN)))
    step.rename(tmp_path / "moved-away")
    step.symlink_to(victim)
    store.delete(listed)
    assert sorted(p.name for p in victim.iterdir()) == sorted(["authorized_keys", STATE, MANIFEST])
    assert planted == listed


def test_a_checkpoint_of_several_files_is_committed_fetched_and_deleted_whole(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """A framework's checkpoint folder: every file under one manifest, fetched checked, a
    changed one refused, and all of them deleted with it."""
    files = {"model.safetensors": b"weights", "optimizer.pt": b"moments", "trainer_state.json": b"{}"}
    manifest = store.commit(Manifest(step=4, time=1.0, run=RUN), files)
    assert sorted(manifest.files) == sorted(files)
    assert store.committed() == [manifest]
    into = tmp_path / "fetched"
    assert store.fetch(manifest, str(into)) == sorted(files)
    assert {p.name: p.read_bytes() for p in into.iterdir()} == files
    plant(store, step_dir(4, RUN), "optimizer.pt", b"someone else's moments")
    with pytest.raises(CheckpointStoreError, match="optimizer.pt does not match its manifest"):
        store.fetch(manifest, str(tmp_path / "again"))
    assert not any(p.name == "optimizer.pt" for p in (tmp_path / "again").iterdir())
    store.delete(manifest)
    assert store.committed() == []
    if store.fs is None:
        assert not os.path.exists(store._join(step_dir(4, RUN)))  # nothing of it left


@pytest.mark.parametrize("name", ["../up", "a/b", ".hidden", "manifest.json", ""])
def test_a_file_name_that_is_a_path_is_refused_before_anything_is_written(
    store: CheckpointStore, name: str
) -> None:
    with pytest.raises(ValueError, match="cannot name a checkpoint's file"):
        store.commit(Manifest(step=5, time=1.0, run=RUN), {name: b"x"})
    assert store.committed() == []


def test_a_file_hashed_as_it_is_written_has_the_digest_of_its_bytes(tmp_path: Path) -> None:
    """The store hashes a checkpoint as it is written; a writer that seeks back is hashed after."""
    import io

    from airflow_provider_torchdist.spark.node.checkpoint_io import HashingWriter, digest

    with open(tmp_path / "f", "w+b") as out:
        hashing = HashingWriter(out)
        torch.save({"w": torch.arange(1000)}, hashing)
        out.flush()
        out.seek(0)
        assert hashing.sequential and hashing.digest() == digest(out)
    with open(tmp_path / "g", "w+b") as out:
        hashing = HashingWriter(out)
        hashing.write(b"abcdef")
        hashing.seek(2)
        hashing.write(b"XY")
        assert not hashing.sequential
    assert digest(io.BytesIO(b"")) == {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
