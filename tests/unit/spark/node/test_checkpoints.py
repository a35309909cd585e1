"""Checkpoints (``spark/node/checkpoints.py``) load only tensors and plain data by default.

The checkpoint directory is writable from every executor of the run, so a full unpickle of the
newest ``step-*.pt`` would hand rank 0 to whoever planted it. These tests write real checkpoints
with real torch and load them the way a restarted rank does.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.spark.node.checkpoints import (
    CHECKPOINT_ENV,
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


def plant(directory: Path, marker: Path, *, legacy: bool = False) -> Path:
    """Another executor writes a checkpoint with the highest step there can be."""
    directory.mkdir(parents=True, exist_ok=True)
    planted = directory / "step-999999999.pt"
    torch.save({"model": Planted(marker)}, planted, _use_new_zipfile_serialization=not legacy)
    return planted


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

    assert sorted(os.listdir(ckpt_dir)) == ["step-000000001.pt"]  # no torn or hidden temp file
    assert load_latest_checkpoint() == (1, {"lr": 0.1})


def test_a_class_allowed_by_name_saves_and_loads(ckpt_dir: Path) -> None:
    with torch.serialization.safe_globals([RunConfig]):
        save_checkpoint({"config": RunConfig(0.1)}, 2)
        assert load_latest_checkpoint() == (2, {"config": RunConfig(0.1)})
    with pytest.raises(CheckpointRefused, match="RunConfig"):
        load_latest_checkpoint()  # outside the allowance, refused again
