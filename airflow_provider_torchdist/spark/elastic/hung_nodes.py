"""A hang in an elastic run is a node loss: the suspects' nodes leave and the others go on
(docs/hangs.md, "Elastic runs").

When the hang watch (:class:`~airflow_provider_torchdist.spark.driver.hang_watch.HangWatch`) finds an
elastic run hung, it has already put every rank's stacks in the task log and named the suspects
(:class:`~airflow_provider_torchdist.spark.driver.hang_detection.HangVerdict`: the ranks not in a
collective while others wait in one, and the silent ones). :class:`HungNodes` then makes the
suspects' nodes leave, the way a lost node leaves:

1. a signed request in the driver's rendezvous store names those nodes
   (:meth:`~.task.RendezvousStore.leave`); on each of them, the agent's
   :class:`~.task.RestartWatch` runs :func:`~.workers.leave_the_run`: its ranks are killed by PID and its
   torchrun agent is stopped by a signal (torch leaves the rendezvous open when an agent dies of
   one), so that node's Spark task ends as a node that left, and Spark does not run it again;
2. once those ranks' connections are gone, the :class:`~.run.ElasticMonitor` takes it as a loss:
   the history notes it (``the node on <host> hung``), and the survivors still blocked in a
   collective are restarted; they meet again without the node and resume from the latest checkpoint.

When no node can be singled out (every rank waits in a collective, every node holds a suspect, or
fewer than MIN ranks would be left), or the nodes do not leave within :data:`LEAVE_TIMEOUT_S`,
it declines: the run is stopped and fails with ``TrainingHung``, as a fixed run does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from airflow_provider_torchdist.spark.wire.outcome import RankFailure

if TYPE_CHECKING:
    from airflow_provider_torchdist.spark.driver.hang_detection import HangDetector, HangVerdict
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

#: How long the hung nodes' ranks may take to be gone after the request (the agents poll the store
#: every 0.2 s; a node whose executor froze whole never answers: the run is then stopped).
LEAVE_TIMEOUT_S = 30.0
#: Why such a node's agent stopped, as its task says so in the log.
LEFT_HUNG = "the driver found this node hung: its ranks were killed and it leaves the run"


class _Store(Protocol):
    def leave(self, nodes: list[int]) -> int: ...


class _Monitor(Protocol):
    def lost(self, executors: dict[str, str], decommissioned: bool = ..., hung: bool = ...) -> None: ...


class HungNodes:
    """An elastic run's answer to a hang (see the module docstring): call it with the verdict; True
    when the suspects' nodes left and the run goes on without them.

    Example::

        hung = HungNodes(spec, store, monitor, channel.hangs, channel.say)
        watch_hangs(channel, spec, lambda _: cancel(), survive=hung)
    """

    def __init__(
        self,
        spec: JobSpec,
        store: _Store,
        monitor: _Monitor,
        ranks: HangDetector,
        say: Callable[[str], None],
        leave_timeout: float = LEAVE_TIMEOUT_S,
    ) -> None:
        self._spec, self._store, self._monitor, self._ranks = spec, store, monitor, ranks
        self._say, self._leave_timeout = say, leave_timeout
        #: The nodes made to leave: their agents' goodbyes are no further loss (over Spark Connect).
        self.dropped: set[int] = set()

    def __call__(self, verdict: HangVerdict) -> bool:
        nodes = self.nodes_to_drop(verdict)
        if not nodes:
            return False
        named = ", ".join(f"node {n} on {host}" for n, host in sorted(nodes.items()))
        self._say(
            f"hang: elastic run: {named} leave(s) the run as a lost node: its ranks are killed, and the "
            "other ranks restart from the latest checkpoint and meet again without it"
        )
        asked = time.time()
        self.dropped |= set(nodes)
        try:
            self._store.leave(sorted(nodes))
        except Exception as exc:  # the store is going down with the run: stop it as a fixed run
            self._say(f"hang: {named} could not be told to leave ({exc!r}): the run is stopped instead")
            return False
        if not self._gone(set(nodes)):
            self._say(
                f"hang: {named} did not leave within {self._leave_timeout:g} s (its executor may be frozen "
                "whole): the run is stopped instead"
            )
            return False
        # The survivors started before the request still wait for the hung ranks in a collective.
        self._monitor.lost({f"node {n} (hung)": host for n, host in nodes.items()}, hung=True, at=asked)
        return True

    def nodes_to_drop(self, verdict: HangVerdict) -> dict[int, str]:
        """The suspects' nodes and their hosts; empty (and said why) when the run cannot go on
        without them."""
        of = {state.rank: state for state in verdict.ranks}
        drop = {of[r].node: of[r].host or "this host" for r in verdict.suspects}
        left = [state.rank for state in verdict.ranks if state.node not in drop]
        if not verdict.suspects:
            why = "no rank can be singled out"
        elif None in drop:  # a rank that never said its node: not ours to guess
            why = "a suspect's node is unknown"
        elif not left:
            why = "every node holds a suspect, so none would be left to go on"
        elif len(left) < self._spec.min_processes:
            why = f"only {len(left)} rank(s) would be left, fewer than MIN={self._spec.min_processes}"
        else:
            return {node: host for node, host in drop.items() if node is not None}
        self._say(f"hang: elastic run: {why}; the run is stopped, as a fixed run would be")
        return {}

    def _gone(self, nodes: set[int]) -> bool:
        deadline = time.monotonic() + self._leave_timeout
        while nodes & self._ranks.live_nodes():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def left_hung(host: str) -> RankFailure:
    """The failure a node that left because it hung reports: a signal's, which its task takes as
    a node that left the run (not a failure of the run)."""
    return RankFailure(rank=None, host=host, exc_type="SignalException", message=LEFT_HUNG)
