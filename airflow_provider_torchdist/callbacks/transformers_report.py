"""A Hugging Face ``transformers.TrainerCallback`` that reports the Trainer's logs with ``report()``."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from airflow_provider_torchdist.callbacks.scalars import known_total, scalar_metrics
from airflow_provider_torchdist.spark.node import progress, stop
from airflow_provider_torchdist.spark.node.metrics import report


class TransformersReportCallback(TrainerCallback):
    """Reports each of the Trainer's logs: ``loss``, ``learning_rate``, ``epoch``, ``grad_norm``,
    the ``eval_*`` metrics and the end-of-training summary, as the Trainer names them.

    Example::

        from airflow_provider_torchdist.callbacks import TransformersReportCallback

        trainer = transformers.Trainer(model, args, train_dataset=data,
                                       callbacks=[TransformersReportCallback()])

    A report goes whenever the Trainer logs (``TrainingArguments(logging_steps=...)``), with
    ``step=state.global_step`` and ``total_steps=state.max_steps``. Only global rank 0 reports,
    unless ``all_ranks=True``.

    When the run is stopped (``stop_grace_period``), every rank stops after the same step: the
    Trainer saves its checkpoint (``output_dir/checkpoint-<step>``, as ``save_steps`` would) and
    ends ``train``; ``trainer.train(resume_from_checkpoint=True)`` resumes from it.
    ``save_on_stop=False``: not this.
    """

    def __init__(self, *, all_ranks: bool = False, save_on_stop: bool = True) -> None:
        self.all_ranks = all_ranks
        self.save_on_stop = save_on_stop

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        progress.note_progress()  # a step: progress, for the hang watchdog
        # Every rank asks (a collective: they all reach this hook after the same step).
        if self.save_on_stop and stop.stop_requested(all_ranks=True):
            control.should_save = True
            control.should_training_stop = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not (self.all_ranks or state.is_world_process_zero):
            return
        values = scalar_metrics(logs or {})
        if values:
            report(
                step=state.global_step,
                total_steps=known_total(state.max_steps),
                all_ranks=self.all_ranks,
                **values,
            )
