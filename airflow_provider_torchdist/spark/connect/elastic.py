"""An elastic run (``num_processes="MIN:MAX"``) over Spark Connect.

As on the spark-submit path (:mod:`~airflow_provider_torchdist.spark.elastic`): an ordinary job of
MAX/nproc_per_node tasks, each a torchrun agent for ``--nnodes=MIN:MAX`` on torch's ``c10d``
rendezvous; Spark's task retry brings a lost node back once a slot frees up.

**Where the rendezvous store lives: here, in the Connect client (this process).** It is the one
process of the run that no node's loss takes with it, and the executors already reach it: the
store listens on the run channel's address (the connection's ``channel-host``, or this machine's
address on the route to the server's driver). On a node (task 0's executor, say) the run would
end with that node.

**How a loss is seen.** A Connect client has no ``SparkContext``, so no listener tells it that
Spark lost an executor. What it sees is the node's agent: its channel connection closes without a
goodbye when its process dies (its executor killed, its host gone). That is the loss: the history
notes it, and the survivors, who may be blocked in a collective with the lost ranks, are told to
restart (:class:`~airflow_provider_torchdist.spark.elastic.run.ElasticMonitor`). A host that
freezes keeps its connection open: the survivors then wait for the collective's timeout, and the
server's driver, which sees the executor's heartbeats stop, retries the task. Spark's graceful
decommission is not seen either (the ranks get no chance to checkpoint first).

**Who a node is.** No scheduler vouches for a task here, and the run's token is in every task. So
each node proves a claim secret of its own (:mod:`~..wire.node_claims`), which travels in the job's
input row for its partition alone (:func:`claim_rows`), and gets the run's elastic key (what the
rendezvous state is signed with) only then; the run takes nodes back a bounded number of times in
all (:class:`~.job.ConnectVerifier`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.connect.job import (
    ConnectVerifier,
    SlotWatch,
    followed,
    job_payload,
    open_connect_run,
)
from airflow_provider_torchdist.spark.connect.node_task import connect_elastic_task
from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.hang_watch import watch_hangs
from airflow_provider_torchdist.spark.driver.spark_context import first_line
from airflow_provider_torchdist.spark.elastic.hung_nodes import HungNodes
from airflow_provider_torchdist.spark.wire.channel_auth import Node, NodeRegistry
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import Outcome


def run_connect_elastic(
    spark: Any,
    spec: JobSpec,
    staging: Path,
    host: str,
    open_channel: Callable[..., RunChannel],
    cancel: Callable[[], None],
    py_files: list[str],
) -> Outcome:
    """The elastic job over the Connect session ``spark``: the rendezvous store and the run channel
    (``open_channel(on_failure, ...)``, with the settings every Connect run shares) on ``host``, the
    address the executors reach. Returns the run's outcome."""
    from airflow_provider_torchdist.spark.elastic.run import hang_or_loss
    from airflow_provider_torchdist.spark.elastic.task import RendezvousStore

    # The store needs torch (about a second to import): while the server checks the payload.
    threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
    entry, shipped = job_payload(spark, spec, staging, py_files)
    store = RendezvousStore(host, timeout=spec.rendezvous_timeout + 60)
    watch = NodeWatch(spec, store, cancel, say=lambda text: channel.say(text))
    channel = open_channel(
        watch.stop,
        # The rendezvous gives out the global ranks anew in every generation.
        ranks_of_node=lambda _: range(spec.max_processes),
        verify_node=watch.verifier,
        on_world_size=watch.monitor.world_size,
        on_node_gone=watch.node_gone,
    )
    watch.attach(channel, store.key)
    # A hang is a node loss: the suspects' nodes leave; the run stops only when none can.
    watch.hung = HungNodes(spec, store, watch.monitor, channel.hangs, channel.say)
    with channel:
        open_connect_run(
            channel,
            staging,
            f"elastic mode over Spark Connect: {spec.min_processes} to {spec.max_processes} ranks, "
            f"{spec.num_nodes} Spark task(s) x {spec.nproc_per_node} process(es), join window "
            f"{spec.join_window}s, max_restarts {spec.max_restarts}, rendezvous store on "
            f"{store.address[0]}:{store.address[1]}",
        )
        task = functools.partial(
            connect_elastic_task, spec, channel.address, store.address, str(staging), entry, shipped
        )
        with watch_hangs(channel, spec, lambda _: watch.stop(), survive=watch.hung) as hangs:
            results, error = _run_job(spark, spec, channel, watch, task)
        watch.stopping.set()
        error = hang_or_loss(spec, watch.monitor, channel.failures, channel.say, hangs.error or error)
        emit("channel_close")
    emit("channel_closed")
    return Outcome(
        ok=not channel.failures and error is None,
        failures=channel.failures,
        error=error,
        hosts=sorted({r["host"] for r in map(json.loads, results)}),
        metrics=channel.metrics,
        world_sizes=watch.monitor.history.entries,
    )


class NodeWatch:
    """An elastic run's view of its nodes over Spark Connect: the monitor (losses, restarts, the
    history), the verifier (which node may be claimed again), and a latch that ends the counting of
    losses once the run stops (a failure, a timeout, its end): the nodes Spark then stops are no
    losses, and must neither restart the others nor enter the history."""

    def __init__(
        self, spec: JobSpec, store: Any, cancel: Callable[[], None], say: Callable[[str], None]
    ) -> None:
        from airflow_provider_torchdist.spark.elastic.run import ElasticMonitor

        self.stopping = threading.Event()
        self._cancel = cancel
        self.monitor = ElasticMonitor(spec, store, self.stop, say=say)
        # Every loss costs each survivor one of its max_restarts: a run that took back more nodes
        # than max_restarts + 1 (the last one's comeback after a loss that left no survivor to pay)
        # could not go on anyway, whichever nodes they were.
        self.verifier = ConnectVerifier(spec.num_nodes, on_conflict=say, retries=spec.max_restarts + 1)
        #: The run channel's registry of nodes, once the channel is open.
        self.registry: NodeRegistry | None = None
        #: What makes hung nodes leave (their goodbyes are then no loss of its own).
        self.hung: HungNodes | None = None

    def attach(self, channel: RunChannel, elastic_key: bytes) -> None:
        """Watch ``channel``'s nodes (before any task starts): each must prove its own claim secret,
        and only then gets ``elastic_key``, the key of the run's rendezvous state."""
        self.registry = channel.registry
        channel.registry.claim_secret = self.verifier.claim_secret
        channel.registry.elastic_key = elastic_key

    def stop(self) -> None:
        """Stop the run: its job is cancelled, and no node counts as lost from now on."""
        self.stopping.set()
        self._cancel()

    def node_gone(self, node: Node) -> None:
        """A node's agent is gone (its connection closed without a goodbye, or it said it left)."""
        # Only the node's latest registration counts: an earlier one (a host that froze, then came
        # back) may close long after Spark's retry took its place.
        if self.stopping.is_set() or self.registry is None or self.registry.current(node.node) is not node:
            return
        if self.hung is not None and node.node in self.hung.dropped:
            return  # made to leave because it hung: noted as such once its ranks were gone
        self.verifier.release(node.node)
        self.monitor.lost({f"node {node.node}, registration {node.attempt}": node.shown or node.host})


#: A Spark SQL setting: how many partitions a scan of local rows makes (a session setting).
LEAF_PARALLELISM = "spark.sql.leafNodeDefaultParallelism"


def claim_rows(spark: Any, nodes: NodeWatch, count: int) -> Any:
    """The job's input: one row per node, ``(node, claim)`` with its claim secret, node n's row in
    partition n alone. A task receives its own partition's rows (the closure goes to every task),
    so no node's task holds another's secret. The server cuts local rows into as many partitions as
    the session's leaf parallelism says (else its cores'): it is set to the node count."""
    spark.conf.set(LEAF_PARALLELISM, str(count))
    rows = [(n, nodes.verifier.claim_secret(n).hex()) for n in range(count)]
    return spark.createDataFrame(rows, "node int, claim string")


def _run_job(
    spark: Any, spec: JobSpec, channel: RunChannel, nodes: NodeWatch, task: Callable[..., Any]
) -> tuple[list[str], str | None]:
    """The job of MAX/nproc_per_node ordinary tasks; returns each node's result and the job's error
    (None when it succeeded, or when a rank's report tells the story)."""
    watch = SlotWatch(channel, spec.min_nodes, spec.slot_timeout, nodes.stop, elastic=True)
    emit("elastic_stage_submitted")
    try:
        stage = claim_rows(spark, nodes, spec.num_nodes)
        with followed(spark, channel, watch):
            rows = stage.mapInArrow(task, "result string").collect()
        return [row["result"] for row in rows], None
    except Exception as exc:
        return [], watch.error or (None if channel.failures else first_line(exc))
    finally:
        with contextlib.suppress(Exception):  # a session the URL names is the user's: as it was
            spark.conf.unset(LEAF_PARALLELISM)
        emit("elastic_stage_done")
