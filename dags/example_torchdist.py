"""Example: distributed training on Spark, and a downstream task that reads rank 0's result.

The training function and its helper live in this DAG file: the provider pickles them by value,
so Spark executors never need to import the DAG file.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output


def make_batch(rank: int, size: int = 64):
    """A rank's shard of a synthetic regression problem: y = 3x + 1 with noise."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(size, 1, generator=generator)
    return x, 3 * x + 1 + 0.01 * torch.randn(size, 1, generator=generator)


def train(lr: float, epochs: int = 20) -> dict:
    """Data-parallel linear regression with gloo; every rank trains, rank 0's result comes back."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_batch(dist.get_rank())
    for epoch in range(epochs):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if epoch % 5 == 0 or epoch == epochs - 1:
            print(f"epoch {epoch} loss {loss.item():.4f}")
    result = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "loss": loss.item(),
        "state_dict": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
    }
    dist.destroy_process_group()
    return result


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist", "example"],
)
def example_torchdist():
    trained = TorchDistributorOperator(
        task_id="train",
        train_object=train,
        args=[0.1],
        kwargs={"epochs": 40},
        num_processes=2,
        local_mode=False,
        use_gpu=False,
    )

    @task
    def evaluate(value, dag_run=None) -> dict:
        # Rank 0's dict, tensors included; refused unless it was signed for this DAG run's train
        # task: an envelope copied into this XCom from another DAG, run or task never unpickles.
        expect = {"dag_id": dag_run.dag_id, "run_id": dag_run.run_id, "task_id": "train"}
        result = load_output(value, expect=expect)
        weight = result["state_dict"]["weight"].item()
        summary = {
            "rank": result["rank"],
            "world_size": result["world_size"],
            "loss": round(result["loss"], 4),
            "weight": round(weight, 3),
        }
        print(f"RANK0_RESULT {summary}")
        return summary

    evaluate(trained.output)


example_torchdist()
