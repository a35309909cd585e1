"""The driver's side of an elastic run (``num_processes="MIN:MAX"``): see :mod:`.elastic`.

An ordinary stage of MAX/nproc_per_node tasks instead of a barrier stage; the rendezvous store
served here; Spark's executor losses turned into forced restarts and into the ``world_sizes``
history; a verdict that names the losses when the run cannot go on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import threading
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.channel import RunChannel
from airflow_provider_torchdist.spark.events import emit
from airflow_provider_torchdist.spark.executor_loss import ExecutorWatch
from airflow_provider_torchdist.spark.jobspec import JobSpec
from airflow_provider_torchdist.spark.outcome import Outcome
from airflow_provider_torchdist.spark.owner import read_owner_token, write_channel_address
from airflow_provider_torchdist.spark.rank_logs import rank_filter
from airflow_provider_torchdist.spark.spark_context import first_line, stop_spark
from airflow_provider_torchdist.spark.world_sizes import WorldSizeHistory


def run_elastic(spec: JobSpec, staging: Path) -> Outcome:
    """An ordinary stage of MAX/nproc_per_node tasks, each a torchrun agent for ``--nnodes=MIN:MAX``
    on the rendezvous store this driver serves (:mod:`.elastic`)."""
    from pyspark import SparkContext

    from airflow_provider_torchdist.spark.elastic import RendezvousStore, elastic_task
    from airflow_provider_torchdist.spark.scheduler_identity import SchedulerVerifier
    from airflow_provider_torchdist.spark.slots import wait_for_slots

    # The driver serves the rendezvous store, so it needs torch (about a second to import): import it
    # while the JVM starts, which mostly waits on another process.
    threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
    emit("spark_context_start")
    sc = SparkContext.getOrCreate()
    emit("spark_context_up")
    group = f"torchdist-{spec.run_id}"
    owner_token = read_owner_token(staging)

    def cancel() -> None:
        with contextlib.suppress(Exception):
            sc.cancelJobGroup(group)

    try:
        host = sc.getConf().get("spark.driver.host")
        history = WorldSizeHistory(say=lambda text: channel.say(text))
        channel = RunChannel(
            spec.token,
            host,
            staging,
            cancel,  # an agent that gives up (out of restarts, below MIN) ends the run
            # The rendezvous gives out the global ranks anew in every generation: a node's ranks
            # may be any of them (its identity is still its verified host and key).
            ranks_of_node=lambda _: range(spec.max_processes),
            verify_node=SchedulerVerifier(sc, group),
            owner_token=owner_token,
            echo_stdout=owner_token is None,
            rank_filter=rank_filter(spec.log_ranks, staging),
            on_world_size=history.generation,
        )
        store = RendezvousStore(host, timeout=spec.rendezvous_timeout + 60)
        with channel:
            write_channel_address(staging, channel.address)
            channel.say(
                f"elastic mode: {spec.min_processes} to {spec.max_processes} ranks, {spec.num_nodes} Spark "
                f"task(s) x {spec.nproc_per_node} process(es), join window {spec.join_window}s, "
                f"max_restarts {spec.max_restarts}, master {sc.master}"
            )
            if channel.rank_filter:
                channel.say(channel.rank_filter.announcement())
            channel.application(sc.applicationId, sc.uiWebUrl or None)
            wait_for_slots(sc, spec.min_nodes, spec.slot_timeout, channel.say)
            sc.setJobGroup(group, f"torchdist elastic training {spec.run_id}", interruptOnCancel=True)
            stage = sc.parallelize(range(spec.num_nodes), spec.num_nodes)
            noted: set[str] = set()

            def lost() -> None:
                # Survivors may block in a collective with the lost ranks: restart them now.
                for address, lost_host in list(watch.lost.items()):
                    if address not in noted:
                        noted.add(address)
                        history.node_lost(lost_host)
                store.restart_survivors()

            error = None
            watch = ExecutorWatch(sc, lost)
            try:
                with watch:
                    emit("elastic_stage_submitted")
                    results = stage.mapPartitions(
                        functools.partial(elastic_task, spec, channel.address, store.address, str(staging))
                    ).collect()
                    emit("elastic_stage_done")
            except Exception as exc:
                results = []
                if not channel.failures:
                    error = first_line(exc)
            failures = channel.failures
            if failures and history.losses:
                error = _elastic_loss_error(spec, history, failures)
                channel.say(error)
            emit("channel_close")
        emit("channel_closed")
        return Outcome(
            ok=not failures and error is None,
            failures=failures,
            error=error,
            hosts=sorted({r["host"] for r in map(json.loads, results)}),
            metrics=channel.metrics,
            world_sizes=history.entries,
        )
    finally:
        stop_spark(sc, fast=spec.fast_jvm_start)


def _elastic_loss_error(spec: JobSpec, history: WorldSizeHistory, failures: list[Any]) -> str:
    """Why an elastic run that lost nodes could not go on: below MIN, or out of restarts."""
    if any(f.exc_type == "RendezvousTimeout" for f in failures):
        why = (
            f"fewer than MIN={spec.min_processes} ranks remained and no replacement joined within "
            f"rendezvous_timeout={spec.rendezvous_timeout}s"
        )
    else:
        why = f"a node used up its max_restarts={spec.max_restarts} (each loss costs every survivor one)"
    return f"the elastic run could not go on after losing {history.describe_losses()}: {why}"
