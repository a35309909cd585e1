"""``train_data`` on the node's side: a barrier task writes its ranks' shard files from the blobs
Spark's shuffle brought to its partition (or finds the ones the tasks wrote on its machine), and
points its ranks at them (``TORCHDIST_DATA_DIR``, :mod:`.rank_data`) before torchrun starts.

The driver's side, which deals the rows and makes the blobs, is :mod:`.data_shards`; the same
tasks run under spark-submit (:func:`~airflow_provider_torchdist.spark.app.data_stage`) and over
Spark Connect (:func:`~airflow_provider_torchdist.spark.connect.node_task.connect_node_task`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from airflow_provider_torchdist.spark.data.rank_data import data_environment, forget_data_environment
from airflow_provider_torchdist.spark.data.shard_files import (
    ShardWriter,
    new_node_directory,
    remove_directory,
    write_blobs,
)
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec


def data_barrier_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    driver_output_dir: str | None,
    schema: Any,
    sizes: tuple[int, ...],
    batches: Iterator[Any],
) -> Iterator[Any]:
    """The barrier task of a run with ``train_data`` (``mapInArrow(..., barrier=True)`` over the
    node's blobs): write its ranks' files, then run the node as :func:`.barrier.barrier_task` does.

    A shard that cannot be written (a full disk) is this node's failure, reported with its host.
    """
    import pyarrow as pa

    from airflow_provider_torchdist.spark.node.barrier import barrier_task

    with node_shards(spec, schema, sizes, batches) as prepare:
        for result in barrier_task(spec, channel_address, driver_output_dir, iter(()), prepare=prepare):
            yield pa.RecordBatch.from_pydict({"result": [result]})


@contextlib.contextmanager
def node_shards(
    spec: JobSpec, schema: Any, sizes: tuple[int, ...], batches: Iterator[Any]
) -> Iterator[Callable[[], None]]:
    """What writes this barrier task's ranks' files from its blobs (``batches``) and points the
    ranks at them: the node's ``prepare`` (:func:`.barrier.barrier_task`), whose failure is the
    node's. On the way out the files go, and the setting with them (a reused Python worker must not
    hand the next task this run's shards)."""
    from pyspark import BarrierTaskContext

    directory = new_node_directory()
    node = BarrierTaskContext.get().partitionId()
    ranks = range(node * spec.nproc_per_node, (node + 1) * spec.nproc_per_node)

    def prepare() -> None:
        try:
            writer = ShardWriter(directory, ranks, schema, {r: sizes[r] for r in ranks})
            try:
                write_blobs(batches, writer)
            finally:
                writer.close()  # writes what it still holds: may be what fills the disk
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot write this node's train_data shard into {directory}: {exc}"
            ) from exc
        writer.check_complete()
        os.environ.update(data_environment(directory, spec.train_data_shuffle_seed))

    try:
        yield prepare
    finally:
        forget_data_environment()
        remove_directory(directory)


def shared_data_task(
    spec: JobSpec, channel_address: tuple[str, int], driver_output_dir: str, directory: str, _: Iterator[int]
) -> Iterator[str]:
    """The barrier task of a run whose rows the tasks already wrote into ``directory``, on this
    machine (:func:`on_shared_disk`): the node's ranks read them there."""
    from airflow_provider_torchdist.spark.node.barrier import barrier_task

    def prepare() -> None:
        os.environ.update(data_environment(directory, spec.train_data_shuffle_seed))

    try:
        yield from barrier_task(spec, channel_address, driver_output_dir, iter(()), prepare=prepare)
    finally:
        forget_data_environment()  # a reused Python worker must not hand it to the next task
