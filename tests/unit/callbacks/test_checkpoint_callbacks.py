"""The framework checkpoint callbacks: a real Lightning / Hugging Face Trainer keeps its checkpoints
in the task's store (a local directory, and moto's S3 server reached by s3fs over HTTP), under the
task's retention, listed and loaded as ``save_checkpoint``'s are; a retry resumes from them, a new
DAG run does not, and a planted pickle is refused before the Trainer loads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from airflow_provider_torchdist.spark.node.checkpoint_state import load_state
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spark.node.checkpoints import CheckpointRefused, commit_checkpoint
from tests.unit.spark.node.test_checkpoint_runs import Planted, as_task, uri  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Lightning's own, of torch's pytree


def _store() -> CheckpointStore:
    store = CheckpointStore.from_env()
    assert store is not None
    return store


# -- Lightning ---------------------------------------------------------------------------------------


def _lightning(keep: Any, max_steps: int, ckpt_path: str | None = None) -> tuple[Any, list[int]]:
    """Fit a regressor that validates every 2 steps (``val_loss``); returns the Trainer and the
    steps it trained (``global_step`` before each batch)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    trained: list[int] = []

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            trained.append(self.trainer.global_step)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, _: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[keep],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), data, data, ckpt_path=ckpt_path, weights_only=True)
    return trainer, trained


@pytest.mark.usefixtures("uri")
def test_lightning_keeps_its_checkpoints_in_the_store_and_a_retry_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_provider_torchdist.callbacks import LightningCheckpointCallback

    as_task(monkeypatch, "r1", keep_last=1, keep_best=1, metric="val_loss")
    keep = LightningCheckpointCallback(every_n_steps=3)
    assert keep.resume_path() is None
    _lightning(keep, max_steps=6)
    kept = sorted(_store().committed(), key=lambda m: m.step)
    # Saved at 2, 3, 4, 6 (every 3 steps and after each validation); the best by val_loss and the newest stay.
    assert kept[-1].step == 6 and len(kept) <= 2
    assert all("val_loss" in m.metrics for m in kept if m.step % 2 == 0)
    with _store().open_state(kept[-1]) as source:  # what load_checkpoint opens downstream
        state = load_state(source, "the newest")
    assert state["global_step"] == 6 and "layer.weight" in state["state_dict"]

    as_task(monkeypatch, "r1", try_number=2, keep_last=1, keep_best=1, metric="val_loss")
    again = LightningCheckpointCallback(every_n_steps=3)
    path = again.resume_path()
    assert path is not None and Path(path).is_file()
    trainer, trained = _lightning(again, max_steps=8, ckpt_path=path)
    assert trained == [6, 7] and trainer.global_step == 8  # resumed at step 6, not 0
    assert not Path(path).exists()  # the fetched copy is gone after fit


@pytest.mark.usefixtures("uri")
def test_lightning_in_a_new_dag_run_starts_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchdist.callbacks import LightningCheckpointCallback

    as_task(monkeypatch, "r1")
    _lightning(LightningCheckpointCallback(every_n_steps=2), max_steps=4)
    as_task(monkeypatch, "r2")
    assert LightningCheckpointCallback().resume_path() is None


def test_lightning_refuses_a_planted_pickle_before_the_trainer_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchdist.callbacks import LightningCheckpointCallback

    monkeypatch.setenv("TORCHDIST_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    as_task(monkeypatch, "r1")
    marker = tmp_path / "ran"
    commit_checkpoint(lambda out: torch.save({"state_dict": Planted(marker)}, out), 9)
    with pytest.raises(CheckpointRefused, match=r"step 9: it holds \[.io.open.\]"):
        LightningCheckpointCallback().resume_path()
    assert not marker.exists()


@pytest.mark.parametrize(
    "save",
    [
        # Pickle protocol 4 (STACK_GLOBAL, FRAME): torch's static scan raises on it, and the scan's
        # caller took that as "nothing unsafe".
        lambda state, out: torch.save(state, out, pickle_protocol=4),
        # torch.save's legacy (non-zip) format: the static scan reads only zip checkpoints.
        lambda state, out: torch.save(state, out, _use_new_zipfile_serialization=False),
    ],
    ids=["protocol-4", "legacy-format"],
)
def test_lightning_refuses_a_planted_pickle_the_static_scan_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: Any
) -> None:
    """``resume_path`` is what stands between a planted checkpoint and ``fit(weights_only=False)``
    (or Lightning's default on a torch before 2.6): it must fail closed."""
    from airflow_provider_torchdist.callbacks import LightningCheckpointCallback

    monkeypatch.setenv("TORCHDIST_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    as_task(monkeypatch, "r1")
    marker = tmp_path / "ran"
    commit_checkpoint(lambda out: save({"state_dict": Planted(marker)}, out), 9)
    with pytest.raises(CheckpointRefused, match=r"refused to resume from the checkpoint of step 9"):
        LightningCheckpointCallback().resume_path()
    assert not marker.exists()


# -- Hugging Face ------------------------------------------------------------------------------------


def _transformers(keep: Any, output_dir: Path, max_steps: int, resume: str | None = None) -> tuple[Any, list]:
    import transformers

    class Steps(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seen.append(state.global_step)

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=max_steps,
        logging_steps=2,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    steps = Steps()
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in ids],
        callbacks=[keep, steps],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, steps.seen


@pytest.mark.usefixtures("uri")
def test_transformers_keeps_its_checkpoints_in_the_store_and_a_retry_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchdist.callbacks import TransformersCheckpointCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    as_task(monkeypatch, "r1", keep_last=2)
    keep = TransformersCheckpointCallback()
    assert keep.resume_path(tmp_path / "first") is None
    _transformers(keep, tmp_path / "first", max_steps=12)
    kept = sorted(_store().committed(), key=lambda m: m.step)
    assert [m.step for m in kept] == [8, 12]  # saved at 4, 8, 12; the newest 2 kept
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= kept[-1].files.keys()
    assert "training_args.bin" not in kept[-1].files  # a full pickle, never needed to resume
    assert "loss" in kept[-1].metrics

    as_task(monkeypatch, "r1", try_number=2, keep_last=2)
    again = TransformersCheckpointCallback()
    path = again.resume_path(tmp_path / "second")  # another host's folder: nothing there yet
    assert path == str(tmp_path / "second" / "checkpoint-12")
    trainer, seen = _transformers(again, tmp_path / "second", max_steps=16, resume=path)
    assert seen == [13, 14, 15, 16] and trainer.state.global_step == 16  # resumed at 12
