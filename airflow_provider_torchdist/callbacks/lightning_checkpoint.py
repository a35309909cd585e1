"""A PyTorch Lightning callback that keeps the Trainer's checkpoints in the task's checkpoint store."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl

from airflow_provider_torchdist.callbacks.scalars import scalar_metrics
from airflow_provider_torchdist.spark.node.checkpoint_folders import restore_checkpoint_folder
from airflow_provider_torchdist.spark.node.checkpoint_manifest import STATE
from airflow_provider_torchdist.spark.node.checkpoint_state import (
    OPT_IN,
    CheckpointRefused,
    weights_only_refusal,
)
from airflow_provider_torchdist.spark.node.checkpoints import commit_checkpoint


class LightningCheckpointCallback(pl.Callback):
    """Saves the Trainer's checkpoint (``trainer.save_checkpoint``: weights, optimizers, loops) into
    the task's checkpoint store (``checkpoint_dir``: a local path, ``s3://...``, ...) with the
    logged metrics, under the task's retention (``checkpoint_keep_last``, ``checkpoint_keep_best``
    by ``checkpoint_metric``); it lists in the task's XCom ``checkpoints`` and opens with
    ``load_checkpoint`` like any other.

    Example::

        from airflow_provider_torchdist.callbacks import LightningCheckpointCallback

        keep = LightningCheckpointCallback(every_n_steps=100)
        trainer = lightning.Trainer(strategy="ddp", callbacks=[keep])
        trainer.fit(model, data, ckpt_path=keep.resume_path(), weights_only=True)

    A checkpoint is saved every ``every_n_steps`` optimizer steps, after each validation
    (``after_validation``; its metrics, such as ``val_loss``, rank it), and when the run is stopped
    (with :class:`LightningReportCallback`, ``stop_grace_period``). :meth:`resume_path` fetches the
    checkpoint this run resumes from (an earlier try's; another DAG run's only with
    ``resume_from``) and checks that a ``weights_only`` load takes it.
    """

    def __init__(self, every_n_steps: int | None = None, *, after_validation: bool = True) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps <= 0
        ):
            raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.after_validation = after_validation
        self._saved_step: int | None = None
        self._fetched: Path | None = None

    def resume_path(self) -> str | None:
        """The local path of the checkpoint to pass as ``trainer.fit(ckpt_path=...)``, or None to
        start from the beginning. Call it on every rank: each fetches the files it loads."""
        folder = Path(tempfile.mkdtemp(prefix="torchdist-lightning-resume-"))
        found = restore_checkpoint_folder(folder)
        if found is None:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        self._fetched = folder
        path = folder / STATE
        # A real weights_only load, not the static scan alone, which passes what it cannot read.
        if refusal := weights_only_refusal(str(path)):
            raise CheckpointRefused(
                f"refused to resume from the checkpoint of step {found[0]}: {refusal}. {OPT_IN}"
            )
        return str(path)

    def save(self, trainer: pl.Trainer) -> str | None:
        """Save the Trainer's checkpoint now (every rank calls it, as ``trainer.save_checkpoint``
        wants); returns its URI on global rank 0, else None. Once per step."""
        step = trainer.global_step
        if step == self._saved_step:
            return None
        self._saved_step = step
        with tempfile.TemporaryDirectory(prefix="torchdist-lightning-save-") as tmp:
            path = Path(tmp) / STATE
            # The whole checkpoint (optimizers, loops), not the weights alone; the strategy decides who
            # writes (global rank 0 under DDP).
            trainer.save_checkpoint(path, weights_only=False)
            if not trainer.is_global_zero:
                return None
            if not path.is_file():  # a sharded strategy's checkpoint is a folder of every rank's shards
                raise ValueError(
                    f"the Trainer's checkpoint is not one file ({trainer.strategy.__class__.__name__} wrote "
                    "a folder of shards): LightningCheckpointCallback keeps one-file checkpoints (DDP, "
                    "one device, FSDP with state_dict_type='full'); sharded ones are not supported yet"
                )
            logged = scalar_metrics(trainer.callback_metrics)
            metrics = {name: value for name, value in logged.items() if math.isfinite(value)}
            with open(path, "rb") as written:
                return commit_checkpoint(lambda out: shutil.copyfileobj(written, out), step, metrics=metrics)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object, **kwargs: object) -> None:
        if self.every_n_steps and trainer.global_step > 0 and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.after_validation and not trainer.sanity_checking and trainer.global_step > 0:
            self.save(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._fetched is not None:
            shutil.rmtree(self._fetched, ignore_errors=True)
            self._fetched = None
