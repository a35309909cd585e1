"""The Spark application that ``spark-submit`` runs: ``driver.py <staging>/spec.json``.

Local mode runs torchrun's agent in this process; distributed mode runs one barrier task per
node. Either way every rank reports to this process over the run channel, and the verdict goes
to ``outcome.json`` beside the spec, where the hook reads it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.data.data_shards import (
    TrainDataError,
    distributed_shards,
    has_train_data,
    local_shards,
    remove_shards,
)
from airflow_provider_torchdist.spark.data.rank_data import data_environment
from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.decommission import Decommissions
from airflow_provider_torchdist.spark.driver.executor_loss import (
    ExecutorWatch,
    lost_executor_message,
    wait_for_loss,
)
from airflow_provider_torchdist.spark.driver.finish import exit_without_teardown, finish, finished_code
from airflow_provider_torchdist.spark.driver.hang_watch import kill_own_children, watch_hangs
from airflow_provider_torchdist.spark.driver.owner import read_owner_token, write_channel_address
from airflow_provider_torchdist.spark.driver.rank_logs import rank_filter
from airflow_provider_torchdist.spark.driver.spark_context import (
    cluster_channel,
    first_line,
    open_run,
    spark_driver,
)
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import Outcome
from airflow_provider_torchdist.spark.wire.parent_death import die_with_parent

LOCAL_HOST = "127.0.0.1"


def run_local(spec: JobSpec, staging: Path) -> Outcome:
    """torchrun ``--standalone`` with ``num_processes`` ranks, here on the driver."""
    from airflow_provider_torchdist.spark.node.launcher import launch_node

    emit("launcher_imported", node=0)
    # One node, run here: the driver makes its key itself, no registration.
    ranks = range(spec.num_processes)
    owner_token = read_owner_token(staging)
    channel = RunChannel(
        spec.token,
        LOCAL_HOST,
        staging,
        ranks_of_node=lambda _: ranks,
        owner_token=owner_token,
        echo_stdout=owner_token is None,  # the hook follows the run as its owner
        rank_filter=rank_filter(spec.log_ranks, staging),
    )
    with channel:
        write_channel_address(staging, channel.address)  # for the hook, which follows the run as owner
        channel.say(f"local mode: {spec.num_processes} process(es) on the driver")
        if channel.rank_filter:
            channel.say(channel.rank_filter.announcement())
        shards = None
        if has_train_data(spec):
            try:
                shards = local_shards(spec, staging, channel.say)
            except TrainDataError as exc:
                channel.say(str(exc))
                return Outcome(ok=False, error=str(exc), hosts=[LOCAL_HOST])
            os.environ.update(data_environment(str(shards), spec.train_data_shuffle_seed))
        node = channel.registry.add_local(0, LOCAL_HOST)
        with watch_hangs(channel, spec, kill_own_children) as hangs:  # hang_timeout
            try:
                failures = launch_node(
                    spec,
                    node_rank=0,
                    entry_path=str(staging / spec.entry),
                    channel_address=channel.address,
                    host=LOCAL_HOST,
                    output_dir=str(staging),  # the ranks run here: rank 0 writes its value in place
                    node_key=node.key,
                )
            finally:
                remove_shards(shards, staging)
        channel.agents_failed(failures, node=0)
        emit("channel_close")
    emit("channel_closed")
    return Outcome(
        ok=not channel.failures and hangs.error is None,
        failures=channel.failures,
        error=hangs.error,  # the run hung: the ranks' failures are only how it was ended
        hosts=[LOCAL_HOST],
        metrics=channel.metrics,
        world_sizes=[started(spec.num_processes)],
    )


def started(world_size: int) -> dict[str, object]:
    """A fixed-size run's one ``world_sizes`` entry."""
    return {"time": time.time(), "world_size": world_size, "reason": "start"}


def run_distributed(spec: JobSpec, staging: Path) -> Outcome:
    """A barrier stage of ``num_nodes`` tasks, each running torchrun's agent for its ranks."""
    nproc = spec.nproc_per_node
    with spark_driver(spec) as (sc, group, cancel):
        channel = cluster_channel(
            spec, staging, sc, group, cancel, ranks_of_node=lambda n: range(n * nproc, (n + 1) * nproc)
        )
        with channel:
            mode = f"distributed mode: {spec.num_nodes} Spark task(s) x {nproc} process(es)"
            open_run(channel, sc, spec, staging, group, mode=mode, min_nodes=spec.num_nodes)
            shards = None
            if has_train_data(spec):
                try:
                    shards = distributed_shards(sc, spec, staging, channel.say)
                except TrainDataError as exc:
                    channel.say(str(exc))
                    return Outcome(ok=False, error=str(exc))
            world_sizes = [started(spec.num_processes)]
            try:
                results, error = barrier_stage(sc, spec, channel, staging, (group, cancel), shards)
            finally:
                remove_shards(shards, staging)
            emit("channel_close")
        emit("channel_closed")
        failures = channel.failures
        outcome = Outcome(
            ok=not failures and error is None,
            failures=failures,
            error=error,
            hosts=hosts_of(results),
            metrics=channel.metrics,
            world_sizes=world_sizes,
        )
        finish(outcome, staging)  # before the SparkContext stops (see finish)
        return outcome


def barrier_stage(
    sc: Any,
    spec: JobSpec,
    channel: RunChannel,
    staging: Path,
    job: tuple[str, Callable[[], None]],
    shards: tuple[Any, Any, tuple[int, ...]] | Path | None,
) -> tuple[list[str], str | None]:
    """The barrier stage, one task per node (over its rows with ``shards``), in ``job`` (its job
    group and how to cancel it); returns each node's result and the stage's error (None when it
    succeeded, or when a rank's report tells the story)."""
    from airflow_provider_torchdist.spark.node.barrier import barrier_task

    group, cancel = job
    done = threading.Event()
    threading.Thread(target=_say_while_waiting, args=(channel, spec.num_nodes, done), daemon=True).start()
    # Cancels the stage the moment Spark loses an executor running a node: the ranks on the other
    # hosts may be blocked in a collective with the lost ones.
    watch = ExecutorWatch(sc, cancel)
    # A decommissioned executor's node is going away: the ranks checkpoint, then the run fails.
    leaving = Decommissions(
        sc, group, channel.stops, watch, channel.say, cancel, spec.stop_grace_period, spec.nproc_per_node
    )
    hangs = watch_hangs(channel, spec, lambda _: cancel())  # hung: the stage is cancelled
    try:
        with watch, leaving, hangs:
            emit("barrier_stage_submitted")
            if shards is None:
                stage = sc.parallelize(range(spec.num_nodes), spec.num_nodes).barrier()
                results = stage.mapPartitions(
                    functools.partial(barrier_task, spec, channel.address, str(staging))
                ).collect()
            else:
                results = data_stage(shards, spec, channel.address, str(staging))
            emit("barrier_stage_done")
        if leaving.error:
            channel.say(leaving.error)
        return results, hangs.error or leaving.error
    except Exception as exc:
        if hangs.error:
            return [], hangs.error
        if leaving.error:
            channel.say(leaving.error)
            return [], leaving.error
        error = _lost_executors(watch, channel, spec, exc)
        # When a rank reported, its failure is the story; Spark's is only the cancellation.
        if error is None and not channel.failures:
            error = first_line(exc)
        return [], error
    finally:
        done.set()


def data_stage(
    shards: tuple[Any, Any, tuple[int, ...]] | Path,
    spec: JobSpec,
    channel_address: tuple[str, int],
    staging: str,
) -> list[str]:
    """The barrier stage of a run with ``train_data``: one task per node over its rows."""
    from pyspark import SparkContext

    from airflow_provider_torchdist.spark.data.node_shards import data_barrier_task, shared_data_task

    if isinstance(shards, Path):  # written on this machine, where every task runs
        stage = SparkContext.getOrCreate().parallelize(range(spec.num_nodes), spec.num_nodes).barrier()
        return stage.mapPartitions(
            functools.partial(shared_data_task, spec, channel_address, staging, str(shards))
        ).collect()
    nodes, schema, sizes = shards
    task = functools.partial(data_barrier_task, spec, channel_address, staging, schema, sizes)
    return [row["result"] for row in nodes.mapInArrow(task, "result string", barrier=True).collect()]


def _say_while_waiting(channel: RunChannel, needed: int, done: threading.Event, every: float = 10.0) -> None:
    """A barrier stage starts only when all its slots are free at once; say so while it waits."""
    while not done.wait(every):
        waiting = needed - len(channel.started_nodes)
        if waiting <= 0:
            return
        channel.say(
            f"waiting for {waiting} of {needed} barrier task(s) to start: the stage needs {needed} free "
            "task slots at once, and other work holds some of them"
        )


def _lost_executors(watch: ExecutorWatch, channel: RunChannel, spec: JobSpec, exc: Exception) -> str | None:
    """Say so when the stage failed because Spark lost an executor running one of the nodes."""
    try:
        watch.poll()
        # A node whose agent was signalled (its Python daemon went down with the executor) or a
        # Spark error naming the loss: Spark's status store may lag the failure a moment.
        signalled = any(f.exc_type == "SignalException" for f in channel.agent_failures)
        if not watch.lost and (signalled or "ExecutorLost" in str(exc)):
            wait_for_loss(watch, 1.5)
    except Exception:  # py4j already down: no verdict from Spark
        return None
    if not watch.lost:
        return None
    message = lost_executor_message(list(watch.lost.values()), channel.node_hosts, spec.nproc_per_node)
    channel.say(message)
    return message


def hosts_of(results: list[str]) -> list[str]:
    """The nodes' hosts, in node order, from the barrier tasks' results."""
    import json

    return [r["host"] for r in sorted((json.loads(x) for x in results), key=lambda r: r["node"])]


def main(spec: JobSpec, staging: Path) -> int:
    """Run ``spec``'s job, write the outcome into ``staging``; return the exit code."""
    emit("driver_start")
    try:
        if spec.local_mode:
            outcome = run_local(spec, staging)
        else:
            from airflow_provider_torchdist.spark.elastic.run import run_elastic

            outcome = run_elastic(spec, staging) if spec.elastic else run_distributed(spec, staging)
    except Exception as exc:
        if (code := finished_code(staging)) is not None:  # Spark failed to stop once the outcome was out
            print(f"[torchdist] stopping Spark after the run failed: {type(exc).__name__}: {exc}", flush=True)
            return code
        outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {exc}")
    return finish(outcome, staging)


def run_and_exit(argv: list[str]) -> None:
    """The driver script's entry: run, then exit with the run's code.

    The driver goes when spark-submit's JVM goes (it is the JVM's child): a JVM ended by its
    supervisor's death, or killed outright, must not leave local ranks training for nobody.
    """
    die_with_parent(signal.SIGTERM, parent_may_be_init=True)
    spec_path = Path(argv[1])
    spec = JobSpec.read(spec_path)
    code = main(spec, spec_path.parent)
    emit("driver_exit", code=code)
    if spec.local_mode:  # torchrun's agent ran here, so torch is loaded: its teardown costs 0.4 s
        exit_without_teardown(code)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    run_and_exit(sys.argv)
