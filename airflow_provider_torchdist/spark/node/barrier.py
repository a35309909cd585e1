"""The barrier-stage task: one per torchrun node, run inside a Spark executor's Python worker."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import NodeStarted


def visible_devices(assigned: Iterable[str], preset: str | None) -> list[str]:
    """The GPUs a task may use: Spark's assignment, within what the cluster already made visible.

    PySpark's TorchDistributor ignores Spark's assignment when ``CUDA_VISIBLE_DEVICES`` is preset,
    so two tasks on one host can land on the same GPU. Intersecting keeps both constraints.
    """
    assigned = [a.strip() for a in assigned]
    if not preset:
        return assigned
    allowed = {p.strip() for p in preset.split(",") if p.strip()}
    return [a for a in assigned if a in allowed]


def gpu_environment(spec: JobSpec, task_gpus: list[str] | None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for this task's ranks; raises when Spark gave it no usable GPU."""
    if not spec.use_gpu:
        return {}
    if not task_gpus:
        raise RuntimeError(
            "use_gpu=True but Spark assigned this task no GPU. Give executors GPUs "
            "(spark.executor.resource.gpu.amount and a discovery script) and set "
            "spark.task.resource.gpu.amount, or run with use_gpu=False."
        )
    devices = visible_devices(task_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if len(devices) < spec.nproc_per_node:
        raise RuntimeError(
            f"use_gpu=True needs {spec.nproc_per_node} GPU(s) per task, but Spark assigned {task_gpus} "
            f"and CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} leaves {devices}."
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}


def shared_output_dir(driver_output_dir: str | None) -> str | None:
    """The driver's output directory when it is on this machine's filesystem too, else None.

    Its name is random and private to the run (0700), so finding it writable here means the driver
    shares this filesystem (an executor on the driver's machine, or shared storage): rank 0 then
    writes its value there in place, instead of streaming it over the channel.
    """
    if driver_output_dir and os.path.isdir(driver_output_dir) and os.access(driver_output_dir, os.W_OK):
        return driver_output_dir
    return None


def barrier_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    driver_output_dir: str | None,
    _: Iterator[int],
    prepare: Callable[[], None] | None = None,
    entry_path: str | None = None,
    on_driver_lost: Callable[[], None] | None = None,
) -> Iterator[str]:
    """Rendezvous with the other tasks, then run this node's ranks with torchrun's agent.

    Task 0's address is the rendezvous endpoint: task 0 reports its host and a port that was free
    there to the driver over the run channel, and the other tasks get it from the driver the moment
    it arrives (Spark's ``allGather`` would do the same but polls once a second). A failure goes to
    the driver over the same channel, so the driver can cancel the whole stage at once instead of
    waiting for collectives to time out. ``prepare`` runs first, as part of the node (its failure is
    the node's): a run with ``train_data`` writes the node's shards there. ``entry_path``: where the
    payload or script is on this node (default: the file spark-submit shipped, ``SparkFiles``).
    ``on_driver_lost``: called if the driver's end of the channel closes while the node runs (over
    Spark Connect the server's job outlives a dead driver; with spark-submit, the application does not).
    """
    from pyspark import BarrierTaskContext

    from airflow_provider_torchdist.spark.node.rank import die_with_parent

    # If the executor's Python daemon dies (its JVM ended or was killed), this worker and, through
    # their own death signal, its ranks go too: nothing outlives the application.
    die_with_parent()
    ctx = BarrierTaskContext.get()
    node = ctx.partitionId()
    emit("task_start", node=node)
    host = ctx.getTaskInfos()[node].address.rsplit(":", 1)[0]
    # This node's own line to the driver: "started" now, its failures later.
    # Spark's scheduler vouches for this task on the driver's side; the node key comes back.
    client = ChannelClient.as_node(
        channel_address, spec.token, node=node, task_attempt=ctx.taskAttemptId(), host=host
    )
    client.send(NodeStarted())
    try:
        failures = run_node(
            ctx,
            client,
            spec,
            channel_address,
            host=host,
            driver_output_dir=driver_output_dir,
            prepare=prepare,
            entry_path=entry_path,
            on_driver_lost=on_driver_lost,
        )
    except Exception as exc:
        failures = [RankFailure(rank=None, host=host, exc_type=type(exc).__name__, message=str(exc))]
    if failures:
        client.failures(failures)
    client.close()
    emit("task_end", node=node)
    yield json.dumps({"node": node, "host": host, "failed": bool(failures)})


def run_node(
    ctx: Any,
    client: ChannelClient,
    spec: JobSpec,
    channel_address: tuple[str, int],
    *,
    host: str,
    driver_output_dir: str | None,
    prepare: Callable[[], None] | None,
    entry_path: str | None,
    on_driver_lost: Callable[[], None] | None,
) -> list[RankFailure]:
    """This node's work once the driver knows it started (:func:`barrier_task`): ``prepare``, its
    GPUs, the rendezvous endpoint (task 0 announces it, the others wait for it), then torchrun's
    agent; returns the failures of its ranks."""
    from pyspark import SparkFiles

    from airflow_provider_torchdist.spark.node.network import free_port

    node = ctx.partitionId()
    if prepare is not None:
        prepare()
    gpus = ctx.resources().get("gpu")
    os.environ.update(gpu_environment(spec, list(gpus.addresses) if gpus else None))
    if node == 0:  # before importing torch, so the other tasks need not wait for that
        master = (host, free_port(host))
        client.announce_master(*master)
    from airflow_provider_torchdist.spark.node.launcher import launch_node  # imports torch

    emit("launcher_imported", node=node)
    if node != 0:
        master = client.wait_for_master(spec.rendezvous_timeout)
    emit("rendezvous_done", node=node)
    stop_watching = client.watch_driver(on_driver_lost) if on_driver_lost else (lambda: None)
    try:
        return launch_node(
            spec,
            node_rank=node,
            entry_path=entry_path or SparkFiles.get(spec.entry),
            channel_address=channel_address,
            host=host,
            master=master,
            task_cpus=ctx.cpus(),
            output_dir=shared_output_dir(driver_output_dir) if node == 0 else None,
            node_key=client.node_key,
        )
    finally:
        stop_watching()
