"""Spark decommissioning an executor that runs a node of the run: its ranks checkpoint first.

With ``spark.decommission.enabled`` a Worker that is told to leave (a spot or preemptible node's
notice, SIGPWR to the Worker, the master's ``/workers/kill``) decommissions its executors: Spark
schedules nothing more there, and the tasks running there go on until their node is gone. A
training run would lose everything since its last checkpoint when that happens. So when an
executor running one of the run's nodes is decommissioned, the driver stops the run gracefully, as
a timeout does (:mod:`.stop_fanout`, reason :data:`DECOMMISSIONED`), with ``stop_grace_period``:

- **a fixed run** fails with "node decommissioned", naming the host, its nodes and ranks, once
  the ranks have checkpointed and returned (or the grace period is out: the stage is then
  cancelled); a retry resumes from that checkpoint on the executors the cluster has then;
- **an elastic run** shrinks: every rank checkpoints and then waits (:mod:`~airflow_provider_torchdist.spark.node.rank`); after
  the grace period the decommissioned node's task is killed (it leaves the run) and the others
  restart from the checkpoint and meet again without it (:class:`~airflow_provider_torchdist.spark.elastic.run.ElasticMonitor`).

When no rank's code watches for stops, nothing is gained by waiting: the run ends (or shrinks) at
once. Connect runs have no view of the scheduler (the driver is the Connect server): there a
decommission is still a node lost when its executor goes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.driver.executor_loss import ExecutorWatch
from airflow_provider_torchdist.spark.driver.jvm_status import (
    decommissioning_executors,
    executor_address,
    kill_task_attempt,
)
from airflow_provider_torchdist.spark.driver.scheduler_identity import group_tasks
from airflow_provider_torchdist.spark.driver.stop_fanout import StopFanout
from airflow_provider_torchdist.spark.wire.stop_request import DECOMMISSIONED

#: Seconds past the grace period before a fixed run's stage is cancelled: the ranks' return and
#: their goodbyes reach the driver a moment after they checkpointed.
MARGIN_S = 5.0
#: How long a decommissioned node's killed task may take to end (Spark gives the task's Python
#: worker ``spark.python.task.killTimeout``, 2 s by default, before it kills it).
LEAVE_TIMEOUT_S = 30.0


def decommission_message(hosts: list[str], nodes: list[int], nproc_per_node: int, grace: float) -> str:
    """The error of a fixed run stopped because Spark decommissioned executors running its nodes."""
    ranks = [r for n in nodes for r in range(n * nproc_per_node, (n + 1) * nproc_per_node)]
    return (
        f"node decommissioned: Spark decommissioned the executor on {', '.join(hosts)} that ran "
        f"node(s) {nodes} (rank(s) {ranks}), so the run was stopped: its ranks were asked to "
        f"checkpoint and return (stop_grace_period={grace:g} s). A retry of the task resumes from "
        "that checkpoint on the executors the cluster has then."
    )


class Decommissions:
    """Watches Spark's decommissions while the run's stage runs (see the module docstring).

    ``watch``: the stage's :class:`~.executor_loss.ExecutorWatch`, told that a decommissioned
    executor's end is no loss. ``leave``: an elastic run's, called with the decommissioned
    executors' ``host:port`` and hosts once their nodes' tasks were killed and had ended; None for
    a fixed run, which is cancelled with ``cancel`` when its ranks outlast the grace period.

    A stop the run's owner asked for (a timeout, a kill, a clear) stands over a decommission: the
    ranks are stopping already, and an elastic run's node is then not replaced.

    Example::

        with Decommissions(sc, group, stops, watch, say, cancel, grace=30.0, nproc_per_node=2) as leaving:
            rdd.collect()
        leaving.error  # "node decommissioned: ..." or None
    """

    def __init__(
        self,
        sc: Any,
        group: str,
        stops: StopFanout,
        watch: ExecutorWatch,
        say: Callable[[str], None],
        cancel: Callable[[], None],
        grace: float,
        nproc_per_node: int,
        leave: Callable[[dict[str, str]], None] | None = None,
        every: float = 0.5,
    ) -> None:
        self._sc, self._group, self._stops, self._watch, self._say = sc, group, stops, watch, say
        self._cancel, self._grace, self._nproc, self._leave = cancel, grace, nproc_per_node, leave
        self._every = every
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        #: The decommissioned nodes' tasks not yet dealt with: ``(task id, node, host, executor)``.
        self._pending: list[tuple[int, int, str, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchdist-decommissions", daemon=True)
        #: A fixed run's error once it was stopped for a decommission.
        self.error: str | None = None

    def __enter__(self) -> Decommissions:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def poll(self) -> bool:
        """Check once; True when executors running the run's nodes were newly decommissioned."""
        new = set(decommissioning_executors(self._sc)) - self._seen
        if not new:
            return False
        tasks = [
            (task_id, node, host, executor)
            for task_id, node, host, status, executor in group_tasks(self._sc, self._group)
            if status == "RUNNING" and executor in new
        ]
        self._seen |= new  # only once the tasks were read: a failed read is tried again
        if tasks and not self._done.is_set():
            self._stop(tasks)
        return bool(tasks)

    def _run(self) -> None:
        while not self._done.wait(self._every):
            try:
                self.poll()
            except Exception:  # a read raced the scheduler, or the SparkContext is stopping
                continue

    def _stop(self, tasks: list[tuple[int, int, str, str]]) -> None:
        addresses = set()
        for _, _, _, executor in tasks:
            with contextlib.suppress(Exception):  # gone already: then its loss is a loss
                addresses.add(executor_address(self._sc, executor))
        self._watch.expect_gone(addresses)
        hosts = sorted({host for _, _, host, _ in tasks})
        nodes = sorted({node for _, node, _, _ in tasks})
        with self._lock:
            first = not self._pending and self._stops.request is None
            self._pending += tasks
        if not first:
            # The ranks are stopping already: the owner's stop, or this run's first decommission,
            # whose end deals with these nodes too.
            why = "the run's owner is stopping it already" if self._stops.stopper_asked else "it leaves too"
            self._say(f"Spark is decommissioning the executor on {', '.join(hosts)} (node(s) {nodes}): {why}")
            return

        def fail_the_run(reached: int) -> None:
            # A stop that reached no rank found them all returned: the run ends as it would have.
            # Set before the ranks have the request: the stage may end as soon as they return.
            if reached and self._leave is None:
                self.error = decommission_message(hosts, nodes, self._nproc, self._grace)

        self._stops.stop(DECOMMISSIONED, self._grace, before_sending=fail_the_run)
        if self._leave is None:
            then = "then the run fails so that a retry resumes from that checkpoint"
            self._say(
                f"Spark is decommissioning the executor on {', '.join(hosts)} (node(s) {nodes}): the ranks are "
                f"asked to checkpoint and return within {self._grace:g} s, {then}"
            )
        else:
            self._say(
                f"Spark is decommissioning the executor on {', '.join(hosts)} (node(s) {nodes}): every "
                f"rank is asked to checkpoint within {self._grace:g} s; then that node leaves and the "
                "others restart from the checkpoint without it"
            )
        threading.Thread(target=self._after_grace, daemon=True).start()

    def _after_grace(self) -> None:
        """A fixed run's stage is cancelled if it outlasts the grace period; an elastic run's
        decommissioned nodes leave after it (at once for either, when no rank watches)."""
        extra = MARGIN_S if self._leave is None else 0.0
        deadline = time.monotonic() + self._grace + extra
        while time.monotonic() < deadline and not self._done.is_set():
            if self._stops.declined.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                break
        if self._done.is_set():
            return
        if self._leave is None:
            self._say("the ranks did not all return within the grace period: the stage is cancelled")
            self._cancel()
            return
        try:
            self._leave_now()
        except Exception as exc:  # py4j refused: the ranks' own wait ends in an error the run reports
            self._say(f"the decommissioned node could not be made to leave: {exc}")

    def _leave_now(self) -> None:
        if self._stops.stopper_asked:
            self._say("the run's owner is stopping the run: the decommissioned node is not replaced")
            return
        with self._lock:
            tasks, self._pending = self._pending, []
        addresses = {}
        for task_id, node, host, executor in tasks:
            kill_task_attempt(self._sc, task_id, f"{DECOMMISSIONED}: node {node} leaves the elastic run")
            with contextlib.suppress(Exception):
                addresses[executor_address(self._sc, executor)] = host
        # The others restart only once the node's agent is gone: an agent still there when its
        # workers are restarted joins the next rendezvous round, and the round would wait for it.
        self._wait_ended({task_id for task_id, _, _, _ in tasks})
        if self._stops.withdraw() and self._leave is not None:
            self._leave(addresses or {f"{host}:?": host for _, _, host, _ in tasks})

    def _wait_ended(self, task_ids: set[int]) -> None:
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while time.monotonic() < deadline and not self._done.is_set():
            try:
                tasks = group_tasks(self._sc, self._group)
            except Exception:  # a read that raced the scheduler: read again
                tasks = []
            if tasks and not any(t[0] in task_ids and t[3] == "RUNNING" for t in tasks):
                return
            time.sleep(0.2)
