"""A PyTorch Lightning callback that reports the Trainer's metrics with ``report()``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from airflow_provider_torchdist.callbacks.lightning_checkpoint import LightningCheckpointCallback
from airflow_provider_torchdist.callbacks.scalars import known_total, scalar_metrics
from airflow_provider_torchdist.spark.node import progress, stop
from airflow_provider_torchdist.spark.node.checkpoints import checkpoint_dir
from airflow_provider_torchdist.spark.node.metrics import report

#: Lightning's own default for ``Trainer(log_every_n_steps=...)``.
LIGHTNING_LOG_EVERY_N_STEPS = 50
#: Where a stopped run's checkpoint goes, in the task's checkpoint directory (else the Trainer's
#: ``default_root_dir``): ``trainer.fit(model, ckpt_path=...)`` resumes from it.
STOP_CHECKPOINT = "stopped.ckpt"


class LightningReportCallback(pl.Callback):
    """Reports ``loss``, ``learning_rate``, ``epoch`` and what the module logs with ``self.log``.

    Example::

        from airflow_provider_torchdist.callbacks import LightningReportCallback

        trainer = lightning.Trainer(strategy="ddp", callbacks=[LightningReportCallback()])

    A report goes every ``every_n_steps`` optimizer steps (by default the Trainer's
    ``log_every_n_steps``) and at the last step, with ``step=trainer.global_step`` and
    ``total_steps=trainer.estimated_stepping_batches`` (left out when the run has no end). ``loss``
    is what ``training_step`` returned, ``learning_rate`` the first optimizer's first parameter
    group's, ``epoch`` ``trainer.current_epoch``; logged scalars keep their names. Only global
    rank 0 reports, unless ``all_ranks=True``.

    When the run is stopped (``stop_grace_period``), every rank stops after the same batch: the
    Trainer saves ``stopped.ckpt`` in the task's checkpoint directory and ends ``fit``; resume with
    ``trainer.fit(model, ckpt_path=path)`` when that file exists. With
    :class:`LightningCheckpointCallback` among the callbacks, the checkpoint goes to the task's
    checkpoint store instead, and its ``resume_path()`` finds it. ``save_on_stop=False``: not this.
    """

    def __init__(
        self, every_n_steps: int | None = None, *, all_ranks: bool = False, save_on_stop: bool = True
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps <= 0
        ):
            raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.all_ranks = all_ranks
        self.save_on_stop = save_on_stop
        self._total_steps: int | None = None
        self._last_step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._total_steps = known_total(trainer.estimated_stepping_batches)
        self._last_step = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        progress.note_progress()  # a step: progress, for the hang watchdog
        # Every rank asks (a collective: they all reach this hook after the same batch).
        if self.save_on_stop and stop.stop_requested(all_ranks=True):
            _save_on_stop(trainer)
            trainer.should_stop = True
        if not (self.all_ranks or trainer.is_global_zero):
            return
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps or LIGHTNING_LOG_EVERY_N_STEPS
        # Several batches make one step under gradient accumulation: one report per step.
        if step <= 0 or step == self._last_step or not (step % every == 0 or step == self._total_steps):
            return
        self._last_step = step
        own = {
            "loss": _loss(outputs),
            "learning_rate": _learning_rate(trainer),
            "epoch": trainer.current_epoch,
        }
        values = scalar_metrics({name: value for name, value in own.items() if value is not None})
        # During the epoch Lightning gives the step's values as they are: nothing here waits on
        # another rank, so reading them on one rank alone cannot hang the others.
        logged = scalar_metrics(trainer.callback_metrics)
        values.update({name: value for name, value in logged.items() if name not in values})
        report(step=step, total_steps=self._total_steps, all_ranks=self.all_ranks, **values)


def _save_on_stop(trainer: pl.Trainer) -> None:
    """Into the task's checkpoint store when the Trainer keeps its checkpoints there (with
    :class:`LightningCheckpointCallback`); else ``stopped.ckpt`` in the checkpoint directory."""
    for callback in trainer.callbacks:
        if isinstance(callback, LightningCheckpointCallback):
            callback.save(trainer)
            return
    directory = checkpoint_dir() or Path(trainer.default_root_dir)
    trainer.save_checkpoint(str(directory / STOP_CHECKPOINT))


def _loss(outputs: Any) -> Any:
    """The loss ``training_step`` returned: a tensor, a mapping with ``"loss"``, or nothing."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs


def _learning_rate(trainer: pl.Trainer) -> float | None:
    optimizers = trainer.optimizers
    if not optimizers or not optimizers[0].param_groups:
        return None
    return optimizers[0].param_groups[0].get("lr")
