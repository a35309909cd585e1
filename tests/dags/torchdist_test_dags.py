"""DAGs for the DAG-level tests: the training callable and its helpers live in this file.

Airflow imports this file under a generated module name that Spark executors cannot import, so
this proves the by-value pickling. ``evaluate`` reads rank 0's value through ``load_output``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

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
        def evaluate(value, dag_run=None) -> dict:
            import torch

            from airflow_provider_torchdist import output_origin

            # Signed and bound to this DAG run's train task: an envelope from another run is refused.
            result = load_output(value, expect={"dag_id": dag_run.dag_id, "run_id": dag_run.run_id})
            assert output_origin(value)["task_id"] == "train"
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


def train_resumable(steps: int, every: int, die_at: int) -> dict:
    """Rank 1 is SIGKILLed once at ``die_at``; a later try resumes from the newest checkpoint."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import checkpoint_dir, load_latest_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    start, state = load_latest_checkpoint() or (0, None)
    weight = state["weight"] if state else torch.zeros(1)
    marker = checkpoint_dir() / "killed-once"
    for step in range(start, steps):
        if step == die_at and dist.get_rank() == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        weight = weight + 1
        dist.barrier()
        if (step + 1) % every == 0:
            save_checkpoint({"weight": weight}, step + 1)
    dist.destroy_process_group()
    return {"resumed_from": start, "weight": weight.item(), "checkpoint_dir": str(checkpoint_dir())}


def train_until_stopped(steps: int) -> dict:
    """Trains slowly until something stops it, checkpointing on the stop; a resumed run (a
    checkpoint exists) trains the rest at full speed. Every rank appends each step it trains to
    ``steps-<rank>.log`` in the checkpoint directory: the test reads what trained, and how often."""
    import time

    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import (
        checkpoint_dir,
        load_latest_checkpoint,
        save_checkpoint,
        stop_requested,
    )

    dist.init_process_group("gloo")
    start, state = load_latest_checkpoint() or (0, None)
    weight = state["weight"] if state else torch.zeros(1)
    log = checkpoint_dir() / f"steps-{dist.get_rank()}.log"
    for step in range(start, steps):
        one = torch.ones(1)
        dist.all_reduce(one)
        weight = weight + 1
        with open(log, "a") as f:
            f.write(f"{step}\n")
        if state is None:
            time.sleep(0.2)  # the first try trains until its execution_timeout stops it
        if stop_requested(all_ranks=True):  # every rank stops after the same step
            save_checkpoint({"weight": weight}, step + 1)
            dist.destroy_process_group()
            return {"stopped_after": step + 1}
    dist.destroy_process_group()
    return {"resumed_from": start, "weight": weight.item()}


def sleep_long() -> None:
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    # The marker comes first: a rank still in its rendezvous is as much a process to kill.
    markers = Path(os.environ["AIRFLOW_HOME"], "sleepers")
    markers.mkdir(exist_ok=True)
    (markers / str(os.getpid())).touch()
    dist.init_process_group("gloo")
    time.sleep(600)


def big_output() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return {"rank": dist.get_rank(), "weights": torch.ones(2_000_000)}  # 8 MB: above the XCom limit


@dag(dag_id="torchdist_e2e_retry_resume", schedule=None, start_date=START, catchup=False)
def retry_resume():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_resumable,
        args=[10, 2, 5],
        num_processes=2,
        local_mode=True,
        retries=1,
        retry_delay=timedelta(seconds=0),
    )


@dag(dag_id="torchdist_e2e_timeout", schedule=None, start_date=START, catchup=False)
def timeout():
    TorchDistributorOperator(
        task_id="train",
        train_object=sleep_long,
        num_processes=2,
        local_mode=False,
        # Long enough for both ranks to start on a loaded 2-core CI machine (25 s was not).
        execution_timeout=timedelta(seconds=60),
    )


@dag(dag_id="torchdist_e2e_graceful_resume", schedule=None, start_date=START, catchup=False)
def graceful_resume():
    # Try 1 is stopped by its execution_timeout and checkpoints in its grace period; try 2 resumes.
    TorchDistributorOperator(
        task_id="train",
        train_object=train_until_stopped,
        args=[2000],
        num_processes=2,
        local_mode=True,
        execution_timeout=timedelta(seconds=40),
        retries=1,
        retry_delay=timedelta(seconds=0),
        stop_grace_period=20,
    )


@dag(dag_id="torchdist_e2e_bad_submit", schedule=None, start_date=START, catchup=False)
def bad_submit():
    # spark-submit's JVM cannot start: its own error must reach the task log (supervised path).
    TorchDistributorOperator(
        task_id="train",
        train_object=big_output,
        num_processes=2,
        local_mode=True,
        conf={"spark.driver.memory": "lots"},
    )


#: A package importable only from this directory: module mode ships it with py_files.
MODULE_PKG = str(Path(__file__).resolve().parents[1] / "integration" / "module_pkg" / "torchdist_modtest")


def module_dag(dag_id: str, local_mode: bool):
    @dag(dag_id=dag_id, schedule=None, start_date=START, catchup=False)
    def pipeline():
        out = Path(os.environ["AIRFLOW_HOME"], dag_id)
        out.mkdir(parents=True, exist_ok=True)
        TorchDistributorOperator(
            task_id="train",
            train_object="-m torchdist_modtest.train",
            args=["--out", str(out), "--lr", "0.5"],
            py_files=[MODULE_PKG],
            num_processes=2,
            local_mode=local_mode,
        )

    return pipeline()


module_dag("torchdist_e2e_module_local", local_mode=True)
module_dag("torchdist_e2e_module_distributed", local_mode=False)


def chatty(tag: str, fail_rank: int = -1) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"chatty {tag} rank {rank}", flush=True)
    dist.barrier()
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} failed on purpose ({tag})")
    dist.destroy_process_group()


@dag(dag_id="torchdist_e2e_log_ranks", schedule=None, start_date=START, catchup=False)
def log_ranks():
    TorchDistributorOperator(
        task_id="train", train_object=chatty, args=["quiet"], num_processes=2, local_mode=True, log_ranks=[0]
    )


@dag(dag_id="torchdist_e2e_log_ranks_failure", schedule=None, start_date=START, catchup=False)
def log_ranks_failure():
    TorchDistributorOperator(
        task_id="train",
        train_object=chatty,
        args=["loud", 1],
        num_processes=2,
        local_mode=False,
        log_ranks="0",
    )


@dag(dag_id="torchdist_e2e_large_output", schedule=None, start_date=START, catchup=False)
def large_output():
    trained = TorchDistributorOperator(
        task_id="train",
        train_object=big_output,
        num_processes=2,
        local_mode=True,
        max_xcom_output_bytes=1024 * 1024,
    )

    @task
    def evaluate(value) -> dict:
        result = load_output(value)
        return {
            "rank": result["rank"],
            "numel": result["weights"].numel(),
            "sum": result["weights"].sum().item(),
        }

    evaluate(trained.output)


retry_resume()
timeout()
graceful_resume()
large_output()
bad_submit()
log_ranks()
log_ranks_failure()


@dag(dag_id="torchdist_e2e_elastic", schedule=None, start_date=START, catchup=False)
def elastic():
    """An elastic range on the embedded master (local[2]): both nodes join within the window; a
    downstream task reads the world-size history from XCom."""
    trained = TorchDistributorOperator(
        task_id="train", train_object=train, args=[1.0], num_processes="{{ '1:2' }}", join_window=2
    )

    @task
    def sizes(ti=None) -> list:
        return [[e["world_size"], e["reason"]] for e in ti.xcom_pull(task_ids="train", key="world_sizes")]

    trained >> sizes()


elastic()


def rows_of_this_rank() -> dict:
    """Every rank's ids through ``rank_batches`` (tensors), gathered on rank 0."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import rank_batches

    dist.init_process_group("gloo")
    ids = torch.cat([b["id"] for b in rank_batches(64, columns=["id"])]).tolist()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, ids)
    return {"world_size": dist.get_world_size(), "shards": shards}


@dag(dag_id="torchdist_e2e_train_data", schedule=None, start_date=START, catchup=False)
def train_data_pipeline():
    """A first task writes a Parquet data set; the ranks train on a query over it, in local mode and
    across 2 Spark tasks of 2 ranks each; a last task checks the shards."""

    @task
    def make_data(run_id=None) -> str:
        import tempfile

        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(tempfile.mkdtemp(prefix="torchdist-e2e-data-"))
        for part in range(3):  # three files of different sizes
            ids = list(range(part * 400, part * 400 + 300 + 50 * part))
            pq.write_table(pa.table({"id": ids, "x": [i * 0.5 for i in ids]}), path / f"part-{part}.parquet")
        return str(path)

    query = "SELECT id, x FROM parquet.`{{ ti.xcom_pull(task_ids='make_data') }}` WHERE id % 7 != 0"
    local = TorchDistributorOperator(
        task_id="train_local",
        train_object=rows_of_this_rank,
        num_processes=2,
        local_mode=True,
        train_data=query,
    )
    distributed = TorchDistributorOperator(
        task_id="train_distributed",
        train_object=rows_of_this_rank,
        num_processes=4,
        nproc_per_node=2,
        train_data=query,
        train_data_shuffle_seed=3,
    )

    @task
    def check(path: str, local_value, distributed_value) -> dict:
        import pyarrow.parquet as pq

        expected = sorted(i for i in pq.read_table(path).column("id").to_pylist() if i % 7)
        summary = {}
        for name, value in (("local", local_value), ("distributed", distributed_value)):
            shards = load_output(value)["shards"]
            every = sorted(i for shard in shards for i in shard)
            summary[name] = {
                "sizes": [len(s) for s in shards],
                "no_duplicates": len(every) == len(set(every)),
                "dropped_at_most_world_minus_1": set(every) <= set(expected)
                and len(expected) - len(every) < len(shards),
            }
        return summary

    data = make_data()
    data >> [local, distributed]
    check(data, local.output, distributed.output)


train_data_pipeline()
