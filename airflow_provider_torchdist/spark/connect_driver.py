"""The training driver over Spark Connect: ``python -m airflow_provider_torchdist.spark.connect_driver
<staging>/spec.json``, with the server's URL in ``TORCHDIST_CONNECT_URL``.

The spark-submit path starts a Spark driver (a JVM) on this machine; here the Spark driver is the
Connect server's, and this process is only a Connect client (``pyspark-client`` suffices, no Java).
It runs the same barrier stage as :func:`.driver.run_distributed`, as a
``mapInArrow(..., barrier=True)`` job tagged ``torchdist-<run id>``, whose tasks each run one
torchrun agent; the run channel is hosted here, so every rank reports to this process, and the
outcome goes to ``outcome.json`` beside the spec, as on the other path. The payload (pickled
callable and args, or the script) travels inside the job, never as a file on a shared path.

The channel cannot ask Spark's scheduler which host runs a task (a Connect client has no
``SparkContext``): a node is accepted from the address it connects from, once, after proving the
run's token (:class:`ConnectVerifier`). The spark-submit path binds nodes more tightly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from airflow_provider_torchdist.spark.channel import RunChannel
from airflow_provider_torchdist.spark.channel_auth import HelloRefused
from airflow_provider_torchdist.spark.driver import started
from airflow_provider_torchdist.spark.events import emit
from airflow_provider_torchdist.spark.jobspec import JobSpec
from airflow_provider_torchdist.spark.outcome import Outcome
from airflow_provider_torchdist.spark.owner import read_owner_token, write_channel_address
from airflow_provider_torchdist.spark.rank_logs import rank_filter
from airflow_provider_torchdist.spark.spark_context import first_line

#: The Connect server's URL (``sc://host:port/;token=...``): in the environment, since it may hold a token.
URL_ENV = "TORCHDIST_CONNECT_URL"


def job_tag(run_id: str) -> str:
    """The tag of the run's Connect operation: what ``interruptTag`` stops."""
    return f"torchdist-{run_id}"


class ConnectVerifier:
    """Accepts each node once, on the host it connects from (the run's token proved in the hello)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: set[int] = set()

    def __call__(self, node: int, task_attempt: int, peer_ip: str) -> str:
        with self._lock:
            if node in self._nodes:
                raise HelloRefused(f"node {node} is registered already")
            self._nodes.add(node)
        return peer_ip


def channel_host(url: str) -> str:
    """This machine's address on the route to the Connect server: where its executors reach us."""
    host = urlparse(url.replace("sc://", "http://", 1)).hostname or "127.0.0.1"
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


def connect_node_task(
    spec: JobSpec, channel_address: tuple[str, int], entry: bytes, _: Iterator[Any]
) -> Iterator[Any]:
    """One barrier task of the job: write the payload privately, then run the node as
    :func:`.barrier.barrier_task` does."""
    import pyarrow as pa

    from airflow_provider_torchdist.spark.barrier import barrier_task

    directory = tempfile.mkdtemp(prefix="torchdist-connect-")  # 0700
    try:
        path = os.path.join(directory, os.path.basename(spec.entry))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(entry)
        for result in barrier_task(spec, channel_address, None, iter(()), entry_path=path):
            yield pa.RecordBatch.from_pydict({"result": [result]})
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def run_connect(spec: JobSpec, staging: Path, url: str) -> Outcome:
    """The barrier stage over a Connect session; returns the run's outcome."""
    from pyspark.sql import SparkSession

    emit("spark_context_start")
    spark = SparkSession.builder.remote(url).getOrCreate()
    emit("spark_context_up")
    tag = job_tag(spec.run_id)
    spark.addTag(tag)

    def cancel() -> None:
        with contextlib.suppress(Exception):  # the session may be gone already
            spark.interruptTag(tag)

    # Ended by the hook (a kill, a timeout, a lost owner): the job on the executors ends too.
    signal.signal(signal.SIGTERM, lambda signum, frame: (cancel(), sys.exit(128 + signum)))

    owner_token = read_owner_token(staging)
    nproc = spec.nproc_per_node
    channel = RunChannel(
        spec.token,
        channel_host(url),
        staging,
        cancel,
        ranks_of_node=lambda n: range(n * nproc, (n + 1) * nproc),
        verify_node=ConnectVerifier(),
        owner_token=owner_token,
        echo_stdout=owner_token is None,
        rank_filter=rank_filter(spec.log_ranks, staging),
    )
    error = None
    results: list[str] = []
    try:
        with channel:
            write_channel_address(staging, channel.address)
            channel.say(
                f"distributed mode over Spark Connect: {spec.num_nodes} Spark task(s) x "
                f"{spec.nproc_per_node} process(es), server {urlparse(url.replace('sc://', 'http://', 1)).netloc}"
            )
            if channel.rank_filter:
                channel.say(channel.rank_filter.announcement())
            entry = (staging / spec.entry).read_bytes()
            task = functools.partial(connect_node_task, spec, channel.address, entry)
            stage = spark.range(spec.num_nodes, numPartitions=spec.num_nodes)
            emit("barrier_stage_submitted")
            try:
                rows = stage.mapInArrow(task, "result string", barrier=True).collect()
                results = [row["result"] for row in rows]
            except Exception as exc:
                if not channel.failures:  # a rank's report is the story; Connect's is the interruption
                    error = first_line(exc)
            emit("barrier_stage_done")
            emit("channel_close")
        emit("channel_closed")
    finally:
        with contextlib.suppress(Exception):
            spark.removeTag(tag)
            spark.stop()
    return Outcome(
        ok=not channel.failures and error is None,
        failures=channel.failures,
        error=error,
        hosts=[r["host"] for r in sorted((json.loads(x) for x in results), key=lambda r: r["node"])],
        metrics=channel.metrics,
        world_sizes=[started(spec.num_processes)],
    )


def main(argv: list[str], environ: dict[str, str] | None = None) -> int:
    """Run the job in ``argv[1]`` over the Connect server in ``TORCHDIST_CONNECT_URL``; write the outcome."""
    spec_path = Path(argv[1])
    staging = spec_path.parent
    spec = JobSpec.read(spec_path)
    url = (environ if environ is not None else os.environ).get(URL_ENV, "")
    emit("driver_start")
    try:
        if not url:
            raise RuntimeError(f"{URL_ENV} is not set: the hook passes the Connect server's URL there")
        outcome = run_connect(spec, staging, url)
    except Exception as exc:
        outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {first_line(exc)}")
    outcome.write(staging)
    if outcome.ok:
        print("[torchdist] training finished on all ranks", flush=True)
        return 0
    for failure in outcome.failures:
        print(f"[torchdist] {failure.summary()}", flush=True)
    if outcome.error:
        print(f"[torchdist] {outcome.error}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
