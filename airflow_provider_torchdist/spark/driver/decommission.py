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

import threading
import time
from collections.abc import Callable
from typing import Any

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

    ``leave``: an elastic run's, called with the decommissioned executors' ``host:port`` and
    hosts once their nodes' tasks were killed; None for a fixed run, which is cancelled with
    ``cancel`` when its ranks outlast the grace period.

    Example::

        with Decommissions(sc, group, stops, say, cancel, grace=30.0, nproc_per_node=2) as watch:
            rdd.collect()
        watch.error  # "node decommissioned: ..." or None
    """

    def __init__(
        self,
        sc: Any,
        group: str,
        stops: StopFanout,
        say: Callable[[str], None],
        cancel: Callable[[], None],
        grace: float,
        nproc_per_node: int,
        leave: Callable[[dict[str, str]], None] | None = None,
        every: float = 0.5,
    ) -> None:
        self._sc, self._group, self._stops, self._say = sc, group, stops, say
        self._cancel, self._grace, self._nproc, self._leave = cancel, grace, nproc_per_node, leave
        self._every = every
        self._seen: set[str] = set()
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
        self._seen |= new
        tasks = [
            (task_id, node, host, executor)
            for task_id, node, host, status, executor in group_tasks(self._sc, self._group)
            if status == "RUNNING" and executor in new
        ]
        if tasks:
            self._stop(tasks)
        return bool(tasks)

    def _run(self) -> None:
        while not self._done.wait(self._every):
            try:
                self.poll()
            except Exception:  # a read raced the scheduler, or the SparkContext is stopping
                continue

    def _stop(self, tasks: list[tuple[int, int, str, str]]) -> None:
        hosts = sorted({host for _, _, host, _ in tasks})
        nodes = sorted({node for _, node, _, _ in tasks})
        if self._leave is None:
            if self.error is None:
                self.error = decommission_message(hosts, nodes, self._nproc, self._grace)
            self._say(
                f"Spark is decommissioning the executor on {', '.join(hosts)} (node(s) {nodes}): the "
                f"ranks are asked to checkpoint and return within {self._grace:g} s, then the run fails "
                "so that a retry resumes from that checkpoint"
            )
        else:
            self._say(
                f"Spark is decommissioning the executor on {', '.join(hosts)} (node(s) {nodes}): every "
                f"rank is asked to checkpoint within {self._grace:g} s; then that node leaves and the "
                "others restart from the checkpoint without it"
            )
        self._stops.stop(DECOMMISSIONED, self._grace)
        threading.Thread(target=self._after_grace, args=(tasks,), daemon=True).start()

    def _after_grace(self, tasks: list[tuple[int, int, str, str]]) -> None:
        """A fixed run's stage is cancelled if it outlasts the grace period; an elastic run's
        decommissioned nodes leave after it (at once for either, when no rank watches)."""
        extra = MARGIN_S if self._leave is None else 0.0
        deadline = time.monotonic() + self._grace + extra
        while time.monotonic() < deadline and not self._done.is_set():
            if self._stops.declined.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                break
        if self._leave is None:
            if not self._done.is_set():
                self._say("the ranks did not all return within the grace period: the stage is cancelled")
                self._cancel()
            return
        addresses = {}
        for task_id, node, host, executor in tasks:
            kill_task_attempt(self._sc, task_id, f"{DECOMMISSIONED}: node {node} leaves the elastic run")
            try:
                addresses[executor_address(self._sc, executor)] = host
            except Exception:  # the executor is gone already: its loss is reported as such
                continue
        # The others restart only once the node's agent is gone: an agent still there when its
        # workers are restarted joins the next rendezvous round, and the round would wait for it.
        self._wait_ended({task_id for task_id, _, _, _ in tasks})
        self._stops.withdraw()
        self._leave(addresses)

    def _wait_ended(self, task_ids: set[int]) -> None:
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                tasks = group_tasks(self._sc, self._group)
            except Exception:  # a read that raced the scheduler: read again
                tasks = []
            if not any(t[0] in task_ids and t[3] == "RUNNING" for t in tasks) and tasks:
                return
            time.sleep(0.2)
