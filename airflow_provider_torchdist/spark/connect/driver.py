"""The training driver over Spark Connect: ``python -m airflow_provider_torchdist.spark.connect.driver
<staging>/spec.json``, with the server's URL in ``TORCHDIST_CONNECT_URL``.

The spark-submit path starts a Spark driver (a JVM) on this machine; here the Spark driver is the
Connect server's, and this process is only a Connect client (``pyspark-client`` suffices, no Java).
It runs the same barrier stage as :func:`~airflow_provider_torchdist.spark.app.run_distributed`, as a
``mapInArrow(..., barrier=True)`` job tagged ``torchdist-<run id>``, whose tasks each run one
torchrun agent; the run channel is hosted here, so every rank reports to this process, and the
outcome goes to ``outcome.json`` beside the spec, as on the other path. The payload (pickled
callable and args, or the script) travels inside the job, never as a file on a shared path.

The channel cannot ask Spark's scheduler which host runs a task (a Connect client has no
``SparkContext``): a node is accepted from the address it connects from, once, after proving the
run's token (:class:`~.job.ConnectVerifier`), and in an elastic run its own claim secret too
(:mod:`.elastic`). The spark-submit path binds nodes more tightly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from airflow_provider_torchdist.spark.app import hosts_of, started
from airflow_provider_torchdist.spark.connect.elastic import run_connect_elastic
from airflow_provider_torchdist.spark.connect.job import (
    ConnectVerifier,
    SlotWatch,
    followed,
    job_payload,
    open_connect_run,
    server_setting,
)
from airflow_provider_torchdist.spark.connect.node_task import connect_node_task
from airflow_provider_torchdist.spark.connect.sessions import open_session, release_session
from airflow_provider_torchdist.spark.data.data_shards import has_train_data, shuffled_shards
from airflow_provider_torchdist.spark.data.shard_plan import TrainDataError
from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.finish import finish
from airflow_provider_torchdist.spark.driver.hang_watch import watch_hangs
from airflow_provider_torchdist.spark.driver.owner import read_owner_token
from airflow_provider_torchdist.spark.driver.rank_logs import rank_filter
from airflow_provider_torchdist.spark.driver.spark_context import first_line
from airflow_provider_torchdist.spark.node.network import route_address
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import Outcome

#: The Connect server's URL (``sc://host:port/;token=...``): in the environment, since it may hold a token.
URL_ENV = "TORCHDIST_CONNECT_URL"
#: The address the run channel listens on for the executors (the connection's ``channel-host``).
CHANNEL_HOST_ENV = "TORCHDIST_CHANNEL_HOST"


def job_tag(run_id: str) -> str:
    """The tag of the run's Connect operation: what ``interruptTag`` stops."""
    return f"torchdist-{run_id}"


def channel_host(url: str, server_driver_host: str | None = None, configured: str | None = None) -> str:
    """Where the run channel listens for the executors: the connection's ``channel-host`` when set;
    else this machine's address on the route to the server's Spark driver (which its executors
    reach, so they likely reach this side of that route too); else on the route to the server."""
    if configured:
        return configured
    server = server_host(url)
    for host in (server_driver_host, server):
        if host:
            with contextlib.suppress(OSError):
                return route_address(host)
    raise RuntimeError(
        f"cannot tell which address of this machine the Connect server's executors reach (no route to "
        f"{server_driver_host or server}): set the connection's extra channel-host"
    )


def server_host(url: str) -> str | None:
    """The Connect server's host in ``sc://host:port/;...``."""
    return urlparse(url.replace("sc://", "http://", 1)).hostname


def redact_url(text: str, url: str) -> str:
    """``text`` without the values of the URL's parameters (the token), as given or percent-encoded."""
    for param in url.partition("/;")[2].split(";"):
        value = param.partition("=")[2]
        if len(value) >= 4:
            for form in {value, unquote(value)}:
                text = text.replace(form, "***")
    return text


@contextlib.contextmanager
def tagged_session(url: str, run_id: str) -> Iterator[tuple[Any, Callable[[], None]]]:
    """The run's Connect session (its own: :mod:`.sessions`), its jobs tagged with the run's tag,
    and a ``cancel`` that interrupts them; SIGTERM (the hook's kill, a timeout, a lost owner) cancels
    them too. On the way out, or on that SIGTERM, the session is released on the server, with its
    Python workers, temp views and settings."""
    emit("spark_context_start")
    spark = open_session(url)
    emit("spark_context_up")
    tag = job_tag(run_id)
    spark.addTag(tag)

    def interrupt() -> None:
        with contextlib.suppress(Exception):  # the session may be gone already
            spark.interruptTag(tag)

    def cancel(wait: float = 2.0, release: bool = False) -> None:
        def calls() -> None:
            interrupt()
            if release:  # the process dies next: nothing else would release the session
                release_session(spark)

        # pyspark retries a call to a slow server with backoff: a kill must not wait for it past
        # the hook's grace (5 s) before SIGKILL.
        worker = threading.Thread(target=calls, daemon=True)
        worker.start()
        worker.join(wait)

    def on_term(signum: int, frame: Any) -> None:
        cancel(3.0, release=True)
        signal.signal(signum, signal.SIG_DFL)  # then die of it at once, as an unhandled SIGTERM does
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield spark, cancel
    finally:
        with contextlib.suppress(Exception):
            spark.removeTag(tag)
        release_session(spark)


def run_connect(spec: JobSpec, staging: Path, url: str, py_files: list[str] | None = None) -> Outcome:
    """The run's job over a Connect session, with the user's ``py_files`` (paths here, shipped
    inside the job); returns the run's outcome. An elastic run goes to :mod:`.elastic`."""
    with tagged_session(url, spec.run_id) as (spark, cancel):
        owner_token = read_owner_token(staging)
        # Where the server's driver runs is the route to it, unless the server hides it.
        host = channel_host(
            url, server_setting(spark, "spark.driver.host", None), os.environ.get(CHANNEL_HOST_ENV)
        )
        # The run channel with the settings every Connect run shares; ``on_failure`` and the rest
        # are the engine mode's.
        open_channel = functools.partial(
            RunChannel,
            spec.token,
            host,
            staging,
            owner_token=owner_token,
            echo_stdout=owner_token is None,
            rank_filter=rank_filter(spec.log_ranks, staging),
        )
        if spec.elastic:
            return run_connect_elastic(spark, spec, staging, host, open_channel, cancel, py_files or [])
        nproc = spec.nproc_per_node
        conflicts: list[str] = []
        channel = open_channel(
            cancel,
            ranks_of_node=lambda n: range(n * nproc, (n + 1) * nproc),
            verify_node=ConnectVerifier(
                spec.num_nodes, on_conflict=lambda text: (conflicts.append(text), cancel())
            ),
        )
        with channel:
            open_connect_run(
                channel,
                staging,
                f"distributed mode over Spark Connect: {spec.num_nodes} Spark task(s) x "
                f"{spec.nproc_per_node} process(es), server {server_host(url)}",
            )
            try:
                with watch_hangs(channel, spec, lambda _: cancel()) as hangs:  # hung: interrupt the job
                    results, error = run_job(spark, spec, staging, channel, cancel, conflicts, py_files or [])
                error = hangs.error or error
            except TrainDataError as exc:  # before any rank started, with the server's error
                channel.say(str(exc))
                results, error = [], str(exc)
            emit("channel_close")
        emit("channel_closed")
    return Outcome(
        ok=not channel.failures and error is None,
        failures=channel.failures,
        error=error,
        hosts=hosts_of(results),
        metrics=channel.metrics,
        world_sizes=[started(spec.num_processes)],
    )


def run_job(
    spark: Any,
    spec: JobSpec,
    staging: Path,
    channel: RunChannel,
    cancel: Callable[[], None],
    conflicts: list[str],
    py_files: list[str],
) -> tuple[list[str], str | None]:
    """The job: one ``mapInArrow(..., barrier=True)`` task per node, once the server has the slots
    and the payload fits its messages; returns each node's result and the job's error (None when
    it succeeded, or when a rank's report tells the story). ``conflicts``: why the channel stopped
    the job (a node claimed twice), as it happens."""
    entry, shipped = job_payload(spark, spec, staging, py_files)
    data = None
    if has_train_data(spec):  # node n's rows come to partition n, through the server's shuffle
        stage, schema, sizes = shuffled_shards(spark, spec, staging, channel.say)
        data = (schema, sizes)
    else:
        stage = spark.range(spec.num_nodes, numPartitions=spec.num_nodes)
    task = functools.partial(connect_node_task, spec, channel.address, str(staging), entry, shipped, data)
    emit("barrier_stage_submitted")
    watch = SlotWatch(channel, spec.num_nodes, spec.slot_timeout, cancel, after_shuffle=data is not None)
    results: list[str] = []
    error = None
    try:
        with followed(spark, channel, watch):
            rows = stage.mapInArrow(task, "result string", barrier=True).collect()
        results = [row["result"] for row in rows]
    except Exception as exc:
        # A rank's report is the story; Connect's is only the interruption.
        error = watch.error or (conflicts[0] if conflicts else None)
        error = error or (None if channel.failures else first_line(exc))
    emit("barrier_stage_done")
    return results, error


def main(argv: list[str], environ: dict[str, str] | None = None) -> int:
    """Run the job in ``argv[1]`` (with the user's py_files in ``argv[2:]``) over the Connect server
    in ``TORCHDIST_CONNECT_URL``; write the outcome."""
    spec_path = Path(argv[1])
    staging = spec_path.parent
    spec = JobSpec.read(spec_path)
    url = (environ if environ is not None else os.environ).get(URL_ENV, "")
    emit("driver_start")
    try:
        if not url:
            raise RuntimeError(f"{URL_ENV} is not set: the hook passes the Connect server's URL there")
        outcome = run_connect(spec, staging, url, argv[2:])
    except Exception as exc:
        outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {first_line(exc)}")
    if outcome.error:  # pyspark may quote the URL (and so the token) in its errors
        outcome = dataclasses.replace(outcome, error=redact_url(outcome.error, url))
    return finish(outcome, staging)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
