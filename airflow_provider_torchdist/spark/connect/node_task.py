"""What each task of a run's Connect job runs on the server's executors: the payload and the user's
py_files written privately, then the node as :func:`~airflow_provider_torchdist.spark.node.barrier.barrier_task`
runs it (or, in an elastic run, :func:`~airflow_provider_torchdist.spark.elastic.task.elastic_task`);
and how a node ends itself when the run's driver is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.private_files import (
    CONNECT_DIR_PREFIX,
    private_directory,
    write_private_bytes,
)


def end_this_node() -> None:
    """The run's driver died (SIGKILLed, its machine lost) while the server's job goes on: end this
    node's ranks (SIGTERM, 5 s, SIGKILL) and its Python worker, instead of training for nobody;
    Spark then fails the task, and so the job."""

    import psutil

    ranks = psutil.Process().children(recursive=True)  # torchrun's workers and theirs
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(ranks, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    os.kill(os.getpid(), signal.SIGKILL)  # this worker too: its task has no driver to report to


@contextlib.contextmanager
def shipped_payload(spec: JobSpec, entry: bytes, py_files: list[tuple[str, bytes]]) -> Iterator[str]:
    """The payload and the user's ``py_files`` (``(name, bytes)``) written privately, the latter on
    this worker's ``sys.path``; yields the entry's path. On the way out, the files go, and the
    worker's environment and ``sys.path`` are as they were: a reused worker must not hand this run's
    settings, nor its py_files, to the next task."""
    environ = dict(os.environ)
    import_path = list(sys.path)
    # 0700; a killed worker's own is removed by the next task on this machine.
    directory = private_directory(CONNECT_DIR_PREFIX)
    try:
        shipped = [private_file(directory, name, data) for name, data in py_files]
        # As spark-submit's --py-files: first on the worker's sys.path, which the ranks (forked by
        # torchrun's agent) inherit.
        # A .py file is a module in its directory; a zip or egg is a path entry itself.
        entries = [p for p in shipped if not p.endswith(".py")]
        sys.path[:0] = [directory, *entries] if len(entries) < len(shipped) else entries
        # Module mode ships no entry: the module comes from py_files or the executors' Python.
        yield directory if spec.kind == "module" else private_file(directory, spec.entry, entry)
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = import_path


def _drain(rows: Iterator[Any]) -> None:
    """Read the task's input (its one row) to the end, or Spark will not reuse this Python worker."""
    for _ in rows:
        pass


def connect_node_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    output_dir: str,
    entry: bytes,
    py_files: list[tuple[str, bytes]],
    data: tuple[Any, tuple[int, ...]] | None,
    rows: Iterator[Any],
) -> Iterator[Any]:
    """One barrier task of the job: the payload and ``py_files`` written privately
    (:func:`shipped_payload`), then the node as :func:`.barrier.barrier_task` runs it. With
    ``train_data``, ``data`` is the shard files' schema and the rows per rank, and ``rows`` the
    node's blobs: the node writes its ranks' files first (:func:`.node_shards.node_shards`)."""
    import pyarrow as pa

    from airflow_provider_torchdist.spark.data.node_shards import node_shards
    from airflow_provider_torchdist.spark.node.barrier import barrier_task

    if data is None:
        _drain(rows)
    with shipped_payload(spec, entry, py_files) as path, contextlib.ExitStack() as stack:
        prepare = None if data is None else stack.enter_context(node_shards(spec, *data, rows))
        # Rank 0 writes its value in place when this client's staging directory is on its
        # machine too (a server beside this worker), else streams it over the channel.
        for result in barrier_task(
            spec,
            channel_address,
            output_dir,
            iter(()),
            prepare=prepare,
            entry_path=path,
            on_driver_lost=end_this_node,
        ):
            yield pa.RecordBatch.from_pydict({"result": [result]})


def connect_elastic_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    store: tuple[str, int],
    output_dir: str,
    entry: bytes,
    py_files: list[tuple[str, bytes]],
    rows: Iterator[Any],
) -> Iterator[Any]:
    """One node of an elastic run's Connect job (an ordinary task, not a barrier one): the payload
    written privately, then the node as :func:`.elastic.task.elastic_task` runs it, on the rendezvous
    store that the run's driver (this job's Connect client) serves. ``rows``: this partition's input,
    the node's row with its claim secret (:func:`~.elastic.claim_rows`)."""
    import pyarrow as pa
    from pyspark import TaskContext

    from airflow_provider_torchdist.spark.elastic.task import elastic_task

    secret = node_claim(rows, TaskContext.get().partitionId())
    with shipped_payload(spec, entry, py_files) as path:
        node = elastic_task(
            spec,
            channel_address,
            store,
            output_dir,
            iter(()),
            entry_path=path,
            on_driver_lost=end_this_node,
            claim_secret=secret,
        )
        for result in node:
            yield pa.RecordBatch.from_pydict({"result": [result]})


def node_claim(rows: Iterator[Any], partition: int) -> bytes:
    """This node's claim secret: from its partition's one ``(node, claim)`` row, which must be its own."""
    found = [row for batch in rows for row in batch.to_pylist()]
    if [row["node"] for row in found] != [partition]:
        raise RuntimeError(
            f"partition {partition} of the elastic job holds the rows of node(s) "
            f"{[row['node'] for row in found]}, not its own alone: the Connect server cut the job's input "
            "otherwise than the run asked (spark.sql.leafNodeDefaultParallelism)"
        )
    return bytes.fromhex(found[0]["claim"])


def private_file(directory: str, name: str, data: bytes) -> str:
    """``data`` in the 0600 file ``directory/<basename of name>``; returns its path."""
    return str(write_private_bytes(Path(directory, os.path.basename(name)), data))
