"""DAGs for the DAG-level tests: the training callable and its helpers live in this file.

Airflow imports this file under a generated module name that Spark executors cannot import, so
this proves the by-value pickling. ``evaluate`` reads rank 0's value through ``load_output``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def gather_ranks():
    """A helper in the DAG file, called by the training function."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ranks = torch.zeros(dist.get_world_size())
    ranks[dist.get_rank()] = dist.get_rank() + 1
    dist.all_reduce(ranks)
    return dist.get_rank(), dist.get_world_size(), ranks


def train(scale: float, fail_rank: int = -1) -> dict:
    rank, world_size, ranks = gather_ranks()
    print(f"training on rank {rank}")
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} was told to fail")
    return {"rank": rank, "world_size": world_size, "ranks": ranks * scale}


def make_dag(dag_id: str, local_mode: bool, fail_rank: int = -1):
    @dag(dag_id=dag_id, schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
    def pipeline():
        trained = TorchDistributorOperator(
            task_id="train",
            train_object=train,
            args=[2.0],
            kwargs={"fail_rank": fail_rank},
            num_processes=2,
            local_mode=local_mode,
        )

        @task
        def evaluate(value) -> dict:
            import torch

            result = load_output(value)
            assert isinstance(result["ranks"], torch.Tensor)
            return {
                "rank": result["rank"],
                "world_size": result["world_size"],
                "tensor_type": type(result["ranks"]).__name__,
                "ranks": result["ranks"].tolist(),
            }

        evaluate(trained.output)

    return pipeline()


make_dag("torchdist_e2e_local", local_mode=True)
make_dag("torchdist_e2e_distributed", local_mode=False)
make_dag("torchdist_e2e_failure", local_mode=False, fail_rank=1)
