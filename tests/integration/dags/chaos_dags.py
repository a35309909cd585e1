"""DAGs of the chaos soak (``bench/chaos.py``; its short form is ``tests/integration/test_chaos.py``).

A small checkpointing training of 2 ranks on a Spark cluster the run's ``conf`` names, with one
retry. Each rank resumes from the latest checkpoint, saves one after every step (so a fault costs
at most the step it interrupted) and stops at once when asked (``stop_requested``). Rank 0 logs
every step it trains to ``<marker_dir>/steps.log``; each rank writes its PID to
``<marker_dir>/rank<R>.pid`` at every start. ``check`` opens the signed output and returns it.

The run's ``conf``: ``marker_dir``, ``steps``, ``conn_id`` (a ``spark`` connection to the
cluster's master) and ``driver_host`` (the address the driver binds to, which the cluster's
executors reach).

- ``chaos_durable``: the run outlives its task (``durable=True``): a retry reattaches to it;
- ``chaos_deferrable``: the triggerer waits for the run (``deferrable=True``);
- ``chaos_hang_watch``: ``chaos_durable`` with ``hang_timeout=30`` (the frozen-rank fault: a
  hung run is found in the soak's time, not after the default 300 s).

``TORCHDIST_CHAOS_STAGING`` (read when the DAG file is parsed) is the runs' ``staging_dir``: the
soak's full form puts it on a small disk of its own, to fill it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output

START = pendulum.datetime(2026, 1, 1, tz="UTC")
CONF = "{{ dag_run.conf['%s'] }}"


def chaos_train(marker_dir: str, steps: str) -> dict[str, Any] | None:
    """All-reduce a one for each of ``steps`` steps, resuming from the latest checkpoint."""
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint, stop_requested

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start, state = load_latest_checkpoint() or (0, None)
    total = state["total"] if state else 0.0
    Path(marker_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    for step in range(start, int(steps)):
        t = torch.ones(1)
        dist.all_reduce(t)
        total += float(t.item())
        if rank == 0:
            with open(Path(marker_dir, "steps.log"), "a") as log:
                log.write(f"{step}\n")
        save_checkpoint({"total": total}, step + 1)
        if stop_requested(all_ranks=True):
            return None
        time.sleep(0.1)
    dist.destroy_process_group()
    return {"steps": int(steps), "total": total, "world_size": world} if rank == 0 else None


def chaos_dag(dag_id: str, **lifetime: Any) -> None:
    @dag(dag_id=dag_id, schedule=None, start_date=START, catchup=False, tags=["torchdist-chaos"])
    def soak() -> None:
        train = TorchDistributorOperator(
            task_id="train",
            train_object=chaos_train,
            kwargs={"marker_dir": CONF % "marker_dir", "steps": CONF % "steps"},
            conn_id=CONF % "conn_id",
            num_processes=2,
            local_mode=False,
            use_gpu=False,
            checkpoint_dir=CONF % "marker_dir" + "/ckpt",
            staging_dir=os.environ.get("TORCHDIST_CHAOS_STAGING") or None,
            conf={
                "spark.driver.host": CONF % "driver_host",
                "spark.driver.bindAddress": CONF % "driver_host",
                "spark.executor.memory": "512m",
                "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            },
            env_vars={"SPARK_LOCAL_IP": CONF % "driver_host"},
            stop_grace_period=10,
            reattach_timeout=120,
            retries=1,
            retry_delay=timedelta(seconds=2),
            **lifetime,
        )

        @task
        def check(value: Any) -> Any:
            return load_output(value)

        check(train.output)

    soak()


chaos_dag("chaos_durable", durable=True)
chaos_dag("chaos_deferrable", deferrable=True)
chaos_dag("chaos_hang_watch", durable=True, hang_timeout=30)
