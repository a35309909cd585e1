"""Example: a small transformer sharded over 2 ranks with FSDP2 (``fully_shard``, on CPU with gloo),
sharded checkpoints, and a task that evaluates the best checkpoint.

Each rank holds half of every parameter and of the optimizer's state. ``save_checkpoint`` of
``get_state_dict(model, optimizer)`` has every rank write its own shards (torch's distributed
checkpoint, DCP), committed once for all; ``asynchronous=True`` returns once the shards are copied,
and the write goes on beside training. A retry resumes with ``load_latest_checkpoint(state=...)``,
resharded if it has another number of ranks. ``evaluate`` reads the best checkpoint (by
``checkpoint_metric``) into an unsharded copy of the model on the Airflow worker.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_checkpoint

VOCAB, WIDTH, LENGTH = 16, 32, 12


def make_model():
    """A 2-layer transformer encoder that learns to repeat each token of its input."""
    import torch

    torch.manual_seed(0)  # every rank builds the same model before it is sharded
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(
                WIDTH, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
            ),
            num_layers=2,
        ),
        torch.nn.Linear(WIDTH, VOCAB),
    )


def make_batch(seed: int, size: int = 32):
    """Random token sequences, and the targets (the same tokens)."""
    import torch

    tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=torch.Generator().manual_seed(seed))
    return tokens, tokens


def train_fsdp(steps: int = 40, every: int = 10) -> dict:
    """FSDP2 training with a sharded checkpoint every ``every`` steps; resumes from the latest."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from airflow_provider_torchdist import (
        load_latest_checkpoint,
        report,
        save_checkpoint,
        wait_for_checkpoints,
    )

    dist.init_process_group("gloo")
    model = make_model()
    for layer in model[1].layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    model_state, optim_state = get_state_dict(model, optimizer)
    start = 0
    if found := load_latest_checkpoint(state={"model": model_state, "optim": optim_state}):
        start, state = found
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(start, steps):
        tokens, targets = make_batch(seed=step * dist.get_world_size() + dist.get_rank())
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(step=step, loss=loss.item())
        if (step + 1) % every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            save_checkpoint(state, step + 1, metrics={"loss": loss.item()}, asynchronous=True)
    result = {"world_size": dist.get_world_size(), "resumed_from": start, "loss": loss.item()}
    wait_for_checkpoints()  # the last save's ranks coordinate over the process group: before it goes
    dist.destroy_process_group()
    return result


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist", "example"],
    doc_md=__doc__,
)
def fsdp_training():
    train = TorchDistributorOperator(
        task_id="train",
        train_object=train_fsdp,
        kwargs={"steps": 40, "every": 10},
        num_processes=2,
        local_mode=True,
        checkpoint_metric="loss",
        checkpoint_keep_last=1,
        checkpoint_keep_best=1,
    )

    @task
    def evaluate(ti=None) -> dict:
        """The best checkpoint, gathered into an unsharded model here, on a held-out batch."""
        import torch

        model = make_model()
        state = load_checkpoint(ti, "best", task_id="train", state={"model": model.state_dict()})
        model.load_state_dict(state["model"])
        tokens, targets = make_batch(seed=10_000)
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        best = ti.xcom_pull(task_ids="train", key="checkpoints")[0]
        summary = {"step": best["step"], "train_loss": best["metrics"]["loss"], "val_loss": loss.item()}
        print(f"FSDP EVALUATION {summary}")
        return summary

    train >> evaluate()


fsdp_training()
