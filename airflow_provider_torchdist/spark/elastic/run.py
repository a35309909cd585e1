"""The driver's side of an elastic run (``num_processes="MIN:MAX"``): see :mod:`.elastic`.

An ordinary stage of MAX/nproc_per_node tasks instead of a barrier stage; the rendezvous store
served here; Spark's executor losses turned into forced restarts and into the ``world_sizes``
history; a verdict that names the losses when the run cannot go on.
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.decommission import Decommissions
from airflow_provider_torchdist.spark.driver.executor_loss import ExecutorWatch
from airflow_provider_torchdist.spark.driver.finish import finish
from airflow_provider_torchdist.spark.driver.hang_watch import watch_hangs
from airflow_provider_torchdist.spark.driver.spark_context import (
    cluster_channel,
    first_line,
    open_run,
    spark_driver,
)
from airflow_provider_torchdist.spark.elastic.hung_nodes import HungNodes
from airflow_provider_torchdist.spark.elastic.task import RendezvousStore
from airflow_provider_torchdist.spark.elastic.world_sizes import WorldSizeHistory
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import HUNG_ERROR_PREFIX, Outcome
from airflow_provider_torchdist.spark.wire.protocol import ProtocolError


def run_elastic(spec: JobSpec, staging: Path) -> Outcome:
    """An ordinary stage of MAX/nproc_per_node tasks, each a torchrun agent for ``--nnodes=MIN:MAX``
    on the rendezvous store this driver serves (:mod:`.elastic`)."""
    # The driver serves the rendezvous store, so it needs torch (about a second to import): import it
    # while the JVM starts, which mostly waits on another process.
    threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
    # The job group is cancelled also when an agent gives up (out of restarts, below MIN).
    with spark_driver(spec) as (sc, group, cancel):
        host = sc.getConf().get("spark.driver.host")
        store = RendezvousStore(host, timeout=spec.rendezvous_timeout + 60)
        monitor = ElasticMonitor(spec, store, cancel, say=lambda text: channel.say(text))
        history = monitor.history
        channel = cluster_channel(
            spec,
            staging,
            sc,
            group,
            cancel,
            # The rendezvous gives out the global ranks anew in every generation: a node's ranks
            # may be any of them (its identity is still its verified host and key).
            ranks_of_node=lambda _: range(spec.max_processes),
            on_world_size=monitor.world_size,
        )
        channel.registry.elastic_key = store.key  # for each node Spark's scheduler vouches for
        with channel:
            mode = (
                f"elastic mode: {spec.min_processes} to {spec.max_processes} ranks, {spec.num_nodes} Spark "
                f"task(s) x {spec.nproc_per_node} process(es), join window {spec.join_window}s, "
                f"max_restarts {spec.max_restarts}"
            )
            open_run(
                channel,
                sc,
                spec,
                staging,
                group,
                mode=mode,
                min_nodes=spec.min_nodes,
                what="elastic training",
            )
            results, error = elastic_stage((sc, group), spec, channel, store.address, monitor, staging)
            failures = channel.failures
            error = hang_or_loss(spec, monitor, failures, channel.say, error)
            emit("channel_close")
        emit("channel_closed")
        outcome = Outcome(
            ok=not failures and error is None,
            failures=failures,
            error=error,
            hosts=sorted({r["host"] for r in map(json.loads, results)}),
            metrics=channel.metrics,
            world_sizes=history.entries,
        )
        finish(outcome, staging)  # before the SparkContext stops (see finish)
        return outcome


def elastic_stage(
    job: tuple[Any, str],
    spec: JobSpec,
    channel: RunChannel,
    store: tuple[str, int],
    monitor: ElasticMonitor,
    staging: Path,
) -> tuple[list[str], str | None]:
    """The stage of elastic agents in ``job`` (the SparkContext and the run's job group); Spark's
    executor losses and decommissions go to ``monitor``. Returns each node's result and the stage's
    error (None when it succeeded, or when a rank reported)."""
    from airflow_provider_torchdist.spark.elastic.task import elastic_task

    sc, group = job
    stage = sc.parallelize(range(spec.num_nodes), spec.num_nodes)
    watch = ExecutorWatch(sc, lambda: monitor.lost(watch.lost))
    # A hang is a node loss: the suspects' nodes leave; the run stops only when none can.
    hung = HungNodes(spec, monitor.store, monitor, channel.hangs, channel.say)
    hangs = watch_hangs(channel, spec, lambda _: monitor.cancel(), survive=hung)
    # A decommissioned node leaves after every rank's checkpoint, not after a crash.
    leaving = Decommissions(
        sc,
        group,
        channel.stops,
        watch,
        channel.say,
        monitor.cancel,
        spec.stop_grace_period,
        spec.nproc_per_node,
        leave=monitor.left,
    )
    try:
        with watch, leaving, hangs:
            emit("elastic_stage_submitted")
            results = stage.mapPartitions(
                functools.partial(elastic_task, spec, channel.address, store, str(staging))
            ).collect()
            emit("elastic_stage_done")
        return results, hangs.error
    except Exception as exc:
        if hangs.error:  # the stage was cancelled because the run hung
            return [], hangs.error
        return [], None if channel.failures else first_line(exc)


class ElasticMonitor:
    """The driver's view of an elastic run's generations and losses.

    - :meth:`world_size`: rank 0 of a new worker group says its size (checked against the range).
    - :meth:`lost`: Spark lost executors. The history notes them, the survivors are told to restart
      now, and a deadline starts: when no group forms again within ``rendezvous_timeout`` plus
      ``join_window`` and a margin for Spark to place retried tasks (every node was lost, or those
      left cannot run), the run is cancelled instead of waiting for executors forever.
    """

    #: Seconds beyond the rendezvous's own timeout for Spark to start a retried task.
    MARGIN_S = 30.0

    def __init__(
        self, spec: JobSpec, store: RendezvousStore, cancel: Callable[[], None], say: Callable[[str], None]
    ) -> None:
        self._spec = spec
        self._store = self.store = store
        self._cancel = cancel
        self.history = WorldSizeHistory(say=say)
        self._noted: set[str] = set()
        #: The executor watch's thread and the decommission watch's may report at once.
        self._lock = threading.Lock()
        self._regrouped = threading.Event()
        #: Set when the deadline after a loss passed without a new worker group.
        self.gave_up = False

    def world_size(self, size: int) -> int:
        spec = self._spec
        if not spec.min_processes <= size <= spec.max_processes or size % spec.nproc_per_node:
            raise ProtocolError(
                f"a worker group of {size} ranks is outside num_processes={spec.num_processes!r} "
                f"(nproc_per_node={spec.nproc_per_node})"
            )
        self._regrouped.set()
        return self.history.generation(size)

    def cancel(self) -> None:
        self._cancel()

    def left(self, executors: dict[str, str]) -> None:
        """Decommissioned nodes left the run once its ranks checkpointed (:mod:`~airflow_provider_torchdist.spark.driver.decommission`):
        every rank waits, so all restart now; the executors' later end is not a second loss."""
        self.lost(executors, decommissioned=True)

    def lost(
        self,
        executors: dict[str, str],
        decommissioned: bool = False,
        hung: bool = False,
        at: float | None = None,
    ) -> None:
        """Nodes left the run (see the class docstring); ``hung``: made to leave by the hang watch
        (:mod:`.hung_nodes`), when they were told to at ``at`` (epoch seconds)."""
        with self._lock:
            new = [(address, host) for address, host in list(executors.items()) if address not in self._noted]
            self._noted.update(address for address, _ in new)
        if not new:
            return
        for _, host in new:
            self.history.node_lost(host, decommissioned=decommissioned, hung=hung)
        # Survivors may block in a collective with the lost ranks: restart those that started
        # before the loss (Spark noticed it a moment after it happened; a hung node's ranks were
        # killed when it was told to leave, and a survivor that restarted since is left alone).
        lost_at = at if at is not None else time.time() - (0.0 if decommissioned else 1.0)
        self._store.restart_survivors(lost_at=lost_at)
        self._regrouped.clear()
        deadline = self._spec.rendezvous_timeout + self._spec.join_window + self.MARGIN_S
        threading.Thread(target=self._deadline, args=(deadline,), daemon=True).start()

    def _deadline(self, seconds: float) -> None:
        if not self._regrouped.wait(seconds):
            self.gave_up = True
            self._cancel()


def elastic_verdict(
    spec: JobSpec, monitor: ElasticMonitor, failures: list[Any], say: Callable[[str], None]
) -> str | None:
    """The run's error when it lost nodes and could not go on (said in the log), else None."""
    if monitor.gave_up:
        error = _elastic_loss_error(spec, monitor.history, failures, nobody_left=True)
    elif failures and monitor.history.losses:
        error = _elastic_loss_error(spec, monitor.history, failures)
    else:
        return None
    say(error)
    return error


def hang_or_loss(
    spec: JobSpec, monitor: ElasticMonitor, failures: list[Any], say: Callable[[str], None], error: str | None
) -> str | None:
    """The run's error: ``error`` when the run hung (no node could be singled out: it fails with
    ``TrainingHung``, whatever nodes it lost before), else the losses' verdict, else ``error``."""
    if error is not None and error.startswith(HUNG_ERROR_PREFIX):
        return error
    return elastic_verdict(spec, monitor, failures, say) or error


def _elastic_loss_error(
    spec: JobSpec, history: WorldSizeHistory, failures: list[Any], *, nobody_left: bool = False
) -> str:
    """Why an elastic run that lost nodes could not go on: below MIN, or out of restarts."""
    if nobody_left:
        why = (
            f"no worker group formed again within rendezvous_timeout={spec.rendezvous_timeout}s (+ "
            f"join_window and {ElasticMonitor.MARGIN_S:.0f}s): no node was left, or Spark could not "
            f"place MIN={spec.min_processes} ranks' tasks"
        )
    elif any(f.exc_type == "RendezvousTimeout" for f in failures):
        why = (
            f"fewer than MIN={spec.min_processes} ranks remained and no replacement joined within "
            f"rendezvous_timeout={spec.rendezvous_timeout}s"
        )
    elif any(f.rank is not None for f in failures):  # the agent gave up on its ranks
        why = f"a node used up its max_restarts={spec.max_restarts} (each loss costs every survivor one)"
    else:  # no rank failed: the agent itself did, with the error that follows
        why = "a surviving node's torchrun agent failed while the survivors regrouped"
    return f"the elastic run could not go on after losing {history.describe_losses()}: {why}"
