"""A Hugging Face ``transformers.TrainerCallback`` that keeps the Trainer's checkpoints in the task's
checkpoint store."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from airflow_provider_torchdist.callbacks.scalars import scalar_metrics
from airflow_provider_torchdist.spark.node.checkpoint_folders import save_checkpoint_folder
from airflow_provider_torchdist.spark.node.checkpoints import resume_choice

#: What is not kept: the pickled ``TrainingArguments`` (a full pickle, which a resume never loads).
NOT_KEPT = ("training_args.bin",)


class TransformersCheckpointCallback(TrainerCallback):
    """Keeps each checkpoint the Trainer saves (``save_steps``, ``save_strategy``, and the save on a
    stop with :class:`TransformersReportCallback`) in the task's checkpoint store
    (``checkpoint_dir``: a local path, ``s3://...``, ...), with the latest logged metrics
    (``loss``, ``eval_loss``, ...), under the task's retention (``checkpoint_keep_last``,
    ``checkpoint_keep_best`` by ``checkpoint_metric``); it lists in the task's XCom
    ``checkpoints`` like any other.

    Example::

        from airflow_provider_torchdist.callbacks import TransformersCheckpointCallback

        keep = TransformersCheckpointCallback()
        trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[keep])
        trainer.train(resume_from_checkpoint=keep.resume_path(args.output_dir))

    Global rank 0 commits the files of ``output_dir/checkpoint-<step>`` (all but
    ``training_args.bin``): with several hosts, the other ranks' RNG files stay on their hosts,
    and a resume restores rank 0's. The Trainer loads a checkpoint's files with
    ``weights_only=True`` itself.
    """

    def resume_path(self, output_dir: str | os.PathLike[str]) -> str | None:
        """Fetch the checkpoint this run resumes from (an earlier try's; another DAG run's only with
        ``resume_from``) into ``output_dir/checkpoint-<step>`` and return that path, for
        ``trainer.train(resume_from_checkpoint=...)``; None to start from the beginning. Call it
        on every rank: each fetches the files it loads."""
        found = resume_choice()
        if found is None:
            return None
        store, manifest = found
        target = Path(output_dir) / f"checkpoint-{manifest.step}"
        store.fetch(manifest, os.fspath(target))  # file by file, renamed whole: ranks may share it
        return str(target)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        save_checkpoint_folder(folder, state.global_step, metrics=_latest_metrics(state), exclude=NOT_KEPT)


def _latest_metrics(state: TrainerState) -> dict[str, float]:
    """Each metric's latest logged value (a train log and an eval log are separate entries)."""
    latest: dict[str, float] = {}
    for entry in state.log_history:
        latest.update(scalar_metrics(entry))
    latest.pop("epoch", None)
    return {name: float(value) for name, value in latest.items() if math.isfinite(value)}
