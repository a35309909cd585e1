"""Benchmark DAGs: one TorchDistributorOperator running the trivial 2-rank workload, per mode."""

from __future__ import annotations

import os
import sys

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workloads"))

from ddp_trivial import train  # noqa: E402


def _bench_dag(local_mode: bool) -> None:
    mode = "local" if local_mode else "distributed"

    @dag(
        dag_id=f"bench_torchdist_{mode}",
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["torchdist", "bench"],
    )
    def bench() -> None:
        TorchDistributorOperator(
            task_id="train", train_object=train, num_processes=2, local_mode=local_mode, use_gpu=False
        )

    bench()


_bench_dag(local_mode=True)
_bench_dag(local_mode=False)
