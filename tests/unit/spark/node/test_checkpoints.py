"""Checkpoints (``spark/node/checkpoints.py``) load only tensors and plain data by default.

The checkpoint directory is writable from every executor of the run, so a full unpickle of the
newest checkpoint would hand rank 0 to whoever planted it (another executor can commit one, with a
manifest, as rank 0 does). These tests write real checkpoints with real torch and load them the way
a restarted rank does. (The same on S3: ``test_checkpoint_runs.py``.)
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.spark.node.checkpoint_manifest import MANIFEST, STATE, Manifest, step_dir
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spark.node.checkpoints import (
    CHECKPOINT_ENV,
    CheckpointNotAFile,
    CheckpointRefused,
    load_latest_checkpoint,
    save_checkpoint,
)


class Planted:
    """What a compromised executor pickles: unpickling it opens (creates) the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


@dataclasses.dataclass
class RunConfig:
    """A class of the user's own, allowed by name with add_safe_globals."""

    lr: float


@pytest.fixture
def ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "ckpt"
    monkeypatch.setenv(CHECKPOINT_ENV, str(directory))
    monkeypatch.setenv("RANK", "0")
    return directory


def plant(directory: Path, marker: Path, *, legacy: bool = False) -> str:
    """Another executor commits a checkpoint of this run with the highest step there can be (it can
    write the manifest as well as rank 0 can); returns its URI."""
    buffer = io.BytesIO()
    torch.save({"model": Planted(marker)}, buffer, _use_new_zipfile_serialization=not legacy)
    store = CheckpointStore(str(directory))
    return store.uri_of(store.commit(Manifest(step=999999999, time=time.time()), buffer.getvalue()))


def test_model_and_optimizer_state_and_plain_values_round_trip(ckpt_dir: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 3, "loss": 0.5}
    save_checkpoint(state, 4)

    step, loaded = load_latest_checkpoint()

    assert step == 4 and loaded["epoch"] == 3 and loaded["loss"] == 0.5
    assert torch.equal(loaded["model"]["weight"], model.state_dict()["weight"])
    assert loaded["optim"]["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip-format", "legacy-format"])
def test_a_planted_checkpoint_is_refused_and_nothing_in_it_runs(
    ckpt_dir: Path, tmp_path: Path, legacy: bool
) -> None:
    save_checkpoint({"model": torch.nn.Linear(2, 2).state_dict()}, 4)  # rank 0's own
    marker = tmp_path / "planted-code-ran"
    planted = plant(ckpt_dir, marker, legacy=legacy)

    with pytest.raises(CheckpointRefused) as refused:
        load_latest_checkpoint()

    assert not marker.exists()
    message = str(refused.value)
    assert str(planted) in message and "Nothing in it was run" in message
    assert "add_safe_globals" in message and "weights_only=False" in message
    if not legacy:
        assert "io.open" in message  # what the file holds, read without unpickling it


def test_weights_only_false_is_the_full_pickle_it_says_it_is(ckpt_dir: Path, tmp_path: Path) -> None:
    """The opt-in: the same planted file runs its code (what the default stops)."""
    marker = tmp_path / "planted-code-ran"
    plant(ckpt_dir, marker)

    step, _ = load_latest_checkpoint(weights_only=False)

    assert step == 999999999 and marker.exists()


def test_saving_what_the_load_would_refuse_fails_at_once_and_keeps_nothing(ckpt_dir: Path) -> None:
    save_checkpoint({"lr": 0.1}, 1)
    with pytest.raises(CheckpointRefused, match=r"save_checkpoint\(step=2\).*RunConfig.*add_safe_globals"):
        save_checkpoint({"config": RunConfig(0.1)}, 2)

    # Nothing of step 2, no temp file (step 1's data position beside it: resume_position).
    assert sorted(os.listdir(ckpt_dir)) == ["positions", step_dir(1, None)]
    assert os.listdir(ckpt_dir / "positions") == [step_dir(1, None)]
    assert sorted(os.listdir(ckpt_dir / step_dir(1, None))) == [MANIFEST, STATE]
    assert load_latest_checkpoint() == (1, {"lr": 0.1})


def test_a_class_allowed_by_name_saves_and_loads(ckpt_dir: Path) -> None:
    with torch.serialization.safe_globals([RunConfig]):
        save_checkpoint({"config": RunConfig(0.1)}, 2)
        assert load_latest_checkpoint() == (2, {"config": RunConfig(0.1)})
    with pytest.raises(CheckpointRefused, match="RunConfig"):
        load_latest_checkpoint()  # outside the allowance, refused again


# -- what another executor can plant in the shared directory: symlinks and FIFOs (issue 40 review) --


def test_a_symlink_planted_at_the_temporary_name_redirects_no_write(ckpt_dir: Path, tmp_path: Path) -> None:
    """Old code wrote to ``.step-….pt.<pid>.tmp`` through whatever was there (another executor could
    guess the pid), then renamed that symlink to the final name: the victim was overwritten. Now
    every file is a fresh mkstemp file renamed over the name (the symlink itself, not its target)."""
    step = ckpt_dir / step_dir(10, None)
    step.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in (f".{STATE}.{os.getpid()}.tmp", f".{MANIFEST}.tmp", STATE, MANIFEST):
        (step / name).symlink_to(victim)

    final = save_checkpoint({"w": torch.ones(1)}, 10)

    assert victim.read_text() == "precious\n"
    assert final == str(step)
    assert not (step / STATE).is_symlink() and (step / STATE).is_file()
    assert load_latest_checkpoint() == (10, {"w": torch.ones(1)})


@pytest.mark.parametrize("planted", ["symlink to a file", "symlink to a FIFO", "FIFO"])
def test_a_newest_checkpoint_that_is_not_a_file_is_refused_without_hanging(
    ckpt_dir: Path, tmp_path: Path, planted: str
) -> None:
    """Old code followed the name: it loaded another file (anything rank 0 may read that torch
    takes), or blocked for good opening a FIFO that nobody writes."""
    save_checkpoint({"w": torch.zeros(1)}, 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    newest = ckpt_dir / step_dir(2, None)  # committed by a manifest another executor wrote
    newest.mkdir()
    (newest / MANIFEST).write_text(Manifest(step=2, time=time.time(), files={STATE: {}}).to_json())
    if planted == "symlink to a file":
        target = outside / "someone-elses.pt"
        torch.save({"w": torch.ones(1)}, target)
    else:
        target = outside / "fifo" if planted != "FIFO" else newest / STATE
        os.mkfifo(target)
    if planted != "FIFO":
        (newest / STATE).symlink_to(target)
    outcome: list[BaseException | tuple] = []

    def load() -> None:
        try:
            outcome.append(load_latest_checkpoint())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(10)
    if loader.is_alive():  # blocked in open(): a writer lets it go, then the test fails
        with open(target, "wb"):
            pass
        loader.join(10)
        pytest.fail(f"load_latest_checkpoint hung on a {planted}")
    (result,) = outcome
    assert isinstance(result, CheckpointNotAFile), result
    assert str(newest / STATE) in str(result) and "Nothing was read" in str(result)
    assert ("a symlink" if planted != "FIFO" else "a FIFO") in str(result)
