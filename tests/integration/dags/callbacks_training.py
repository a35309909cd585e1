"""DAGs that train with a stock framework Trainer whose only change is a report callback.

- ``callbacks_transformers``: a Hugging Face ``Trainer`` on a tiny GPT-2 built from its config (no
  download: ``HF_HUB_OFFLINE=1``) with :class:`TransformersReportCallback`; 16 steps, a log every 2;
- ``callbacks_lightning``: a Lightning ``Trainer(strategy="ddp")`` on a linear regressor with
  :class:`LightningReportCallback`; 24 steps, a log every 2.

Each also keeps its Trainer's checkpoints in the task's checkpoint store with the framework's
checkpoint callback (Hugging Face every 8 steps, ``save_steps``; Lightning every 8 steps), listed
in the task's XCom ``checkpoints`` (the newest 2, by default).

Both train with two ranks (``num_processes=2``, distributed mode on the embedded Spark master: one
Spark task each), in seconds. The ``train`` task pushes the reports to XCom ``metrics``; ``check``
reads them and returns ``{"reports": n, "steps": [...], "total_steps": [...], "names": [...]}``,
and fails when no report carries a loss. ``train``'s own value (rank 0's) says what world the
Trainer saw: ``{"world_size": 2, "rank": 0, "global_step": ..., "max_steps": ...}``.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")
#: Every rank: Hugging Face must never try the Hub (the model is built from a config).
RANK_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def train_transformers() -> dict[str, Any]:
    """A stock Hugging Face Trainer loop; the Trainer finds torchrun's environment itself."""
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from airflow_provider_torchdist.callbacks import (
        TransformersCheckpointCallback,
        TransformersReportCallback,
    )

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    # The Trainer wants an output directory even when it saves nothing: one of its own, removed after.
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=4,  # 64 samples over 2 ranks: 8 steps an epoch
            num_train_epochs=2,
            logging_steps=2,
            learning_rate=1e-3,
            report_to=[],
            save_steps=8,  # kept in the task's checkpoint store by TransformersCheckpointCallback
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=data,
            callbacks=[TransformersReportCallback(), TransformersCheckpointCallback()],
        )
        trainer.train()
    return {
        "world_size": args.world_size,
        "rank": args.process_index,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
    }


def train_lightning() -> dict[str, Any]:
    """A stock Lightning DDP loop over two nodes of one process each (one Spark task each)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from airflow_provider_torchdist.callbacks import LightningCheckpointCallback, LightningReportCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)  # 8 steps an epoch a rank
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_epochs=3,
        log_every_n_steps=2,
        callbacks=[LightningReportCallback(), LightningCheckpointCallback(every_n_steps=8)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), data)
    return {
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "max_steps": int(trainer.estimated_stepping_batches),
    }


@task
def check(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What the callback reported, in short; fails when no report carries a loss."""
    losses = [m for m in metrics or [] if "loss" in m]
    if not losses:
        raise ValueError(f"no report with a loss among {len(metrics or [])}: {metrics!r}"[:2000])
    return {
        "reports": len(metrics),
        "steps": [m["step"] for m in losses],
        "total_steps": sorted({m.get("total_steps") for m in losses}, key=str),
        "names": sorted({k for m in metrics for k in m} - {"rank", "step", "time", "total_steps"}),
    }


#: The same run for both: two ranks, one Spark task each, on the embedded master.
TRAINING = {"num_processes": 2, "local_mode": False, "use_gpu": False, "rank_env": RANK_ENV, "retries": 0}


@dag(dag_id="callbacks_transformers", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def callbacks_transformers():
    trained = TorchDistributorOperator(task_id="train", train_object=train_transformers, **TRAINING)
    check(trained.output["metrics"])


@dag(dag_id="callbacks_lightning", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def callbacks_lightning():
    trained = TorchDistributorOperator(task_id="train", train_object=train_lightning, **TRAINING)
    check(trained.output["metrics"])


callbacks_transformers()
callbacks_lightning()
