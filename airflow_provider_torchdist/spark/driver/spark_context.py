"""The driver's SparkContext: its job group's cancel, the run channel its tasks report to and
what a run says on it first, stopping it fast, and Spark's errors in one line.

Shared by the fixed-size driver (:mod:`~airflow_provider_torchdist.spark.app`) and the elastic one
(:mod:`~airflow_provider_torchdist.spark.elastic.run`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.owner import read_owner_token, write_channel_address
from airflow_provider_torchdist.spark.driver.rank_logs import rank_filter
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec


def release_accumulator_server(sc: Any) -> None:
    """Seam (PySpark private): end the accumulator server's request loop before ``sc.stop()``.

    PySpark's stop ends with ``shutdown()`` of that server, which waits for its ``serve_forever``
    to poll again; this process exits right after and the server's thread is a daemon. No public
    API does this. If PySpark renames the attribute, this does nothing and ``sc.stop()`` is only
    slower (``tests/unit/test_spec.py`` lists this as one of the two allowed seams).
    """
    server = getattr(sc, "_accumulatorServer", None)
    if server is not None:
        server.server_shutdown = True  # ends its request handler's loop
        sc._accumulatorServer = None


def stop_spark(sc: Any, fast: bool = True) -> None:
    """``sc.stop()``; with ``fast`` (``fast_jvm_start``), without waiting for the accumulator
    server's poll loop (measured: ``sc.stop()`` took 0.94 s of a 5.8 s launch without this)."""
    emit("spark_stop")
    if fast:
        release_accumulator_server(sc)
    sc.stop()
    emit("spark_stopped")


PYTHON_TRACEBACK = "Traceback (most recent call last):"


def first_line(exc: BaseException) -> str:
    """The line of ``exc``'s text that says what went wrong: a Spark task's Python error (the last
    line of the worker's traceback, which Spark puts after a line that only says a worker failed),
    else Spark's error condition (``[TABLE_OR_VIEW_NOT_FOUND] The table ...``, as over Spark Connect,
    where the JVM's stack trace follows), else the first line naming an exception or error."""
    text = str(exc).strip().split("JVM stacktrace:", 1)[0].strip()
    raised = python_error(text)
    if raised:
        return f"a Spark task's Python worker failed: {raised}"[:2000]
    if text.startswith("["):
        return text.splitlines()[0].strip()[:2000]
    for line in text.splitlines():
        if "Exception" in line or "Error" in line:
            return line.strip()[:2000]
    return text[:2000]


def python_error(text: str) -> str | None:
    """The exception line of the last Python traceback in ``text`` (``ModuleNotFoundError: ...``):
    the first line after its frames that is not indented; None without a traceback."""
    if PYTHON_TRACEBACK not in text:
        return None
    frames = text.rsplit(PYTHON_TRACEBACK, 1)[1].splitlines()[1:]
    return next((line.strip() for line in frames if line.strip() and not line[0].isspace()), None)


def group_canceller(sc: Any, group: str) -> Callable[[], None]:
    """Cancel the run's job group (its stage and the tasks in it)."""

    def cancel() -> None:
        # A late report may arrive after the SparkContext stopped: then there is nothing to cancel.
        with contextlib.suppress(Exception):
            sc.cancelJobGroup(group)

    return cancel


def cluster_channel(
    spec: JobSpec, staging: Path, sc: Any, group: str, cancel: Callable[[], None], **settings: Any
) -> RunChannel:
    """The run channel of a run whose nodes are Spark tasks of ``group``: on the driver's host, its
    nodes vouched for by Spark's scheduler, an agent's failure cancelling the stage. ``settings``:
    ``ranks_of_node`` and whatever else the mode adds."""
    from airflow_provider_torchdist.spark.driver.scheduler_identity import SchedulerVerifier

    owner_token = read_owner_token(staging)
    return RunChannel(
        spec.token,
        sc.getConf().get("spark.driver.host"),
        staging,
        cancel,
        verify_node=SchedulerVerifier(sc, group),
        owner_token=owner_token,
        echo_stdout=owner_token is None,  # the hook follows the run as its owner
        rank_filter=rank_filter(spec.log_ranks, staging),
        **settings,
    )


@contextlib.contextmanager
def spark_driver(spec: JobSpec) -> Iterator[tuple[Any, str, Callable[[], None]]]:
    """The driver's SparkContext for a run on a cluster, the run's job group and its canceller;
    the context is stopped on the way out."""
    from pyspark import SparkContext

    emit("spark_context_start")
    sc = SparkContext.getOrCreate()
    emit("spark_context_up")
    group = f"torchdist-{spec.run_id}"
    try:
        yield sc, group, group_canceller(sc, group)
    finally:
        stop_spark(sc, fast=spec.fast_jvm_start)


def open_run(
    channel: RunChannel,
    sc: Any,
    spec: JobSpec,
    staging: Path,
    group: str,
    *,
    mode: str,
    min_nodes: int,
    what: str = "training",
) -> None:
    """What a cluster run does first, its channel open: the channel's address for the hook (which
    follows the run as its owner), the run's ``mode`` line, the application, the wait for
    ``min_nodes`` task slots, and the job group its stage runs in (described as ``what``)."""
    from airflow_provider_torchdist.spark.driver.master_state import slot_holders
    from airflow_provider_torchdist.spark.driver.slots import wait_for_slots

    write_channel_address(staging, channel.address)
    channel.say(f"{mode}, master {sc.master}")
    if channel.rank_filter:
        channel.say(channel.rank_filter.announcement())
    channel.application(sc.applicationId, sc.uiWebUrl or None)
    holders = functools.partial(slot_holders, spec.master_web_ui, sc.applicationId)
    wait_for_slots(sc, min_nodes, spec.slot_timeout, channel.say, holders=holders)
    sc.setJobGroup(group, f"torchdist {what} {spec.run_id}", interruptOnCancel=True)
