"""What the driver knows of a run while it goes: nodes, failures, metrics, rendezvous endpoints.

The run channel (:mod:`~airflow_provider_torchdist.spark.driver.channel`) records here what its verified
connections say; nothing here touches a socket, so tests drive it directly. Thread-safe.

Example::

    ledger = RunLedger()
    ledger.rank_raised(1, "10.0.0.2", RankError(exc_type="ValueError", message="boom"))
    ledger.agents_failed([RankFailure(rank=1, host="10.0.0.2", exitcode=1)])
    ledger.failures   # [RankFailure(rank=1, host="10.0.0.2", exitcode=1, exc_type="ValueError", ...)]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import MasterAnswer, RankError

#: What a rank's error says when the rank failed because a peer's connection went away (gloo's
#: "Connection closed by peer", "Connection reset by peer"): such a rank is a casualty, never the
#: root cause, of a peer that died.
PEER_LOSS = ("by peer",)
#: How the failure of a rank that vanished without a word is described.
VANISHED_MESSAGE = (
    "the process died without reporting an error (killed by a signal, "
    "e.g. SIGKILL from the OOM killer, or ended by os._exit)"
)


class RunLedger:
    """The run's state as ranks and agents report it, and the policy that turns it into failures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Wakes ``wait_for_master`` callers: an endpoint arrived, a node failed, or the run is closing.
        self._changed = threading.Condition(self._lock)
        #: Each rank's own report of the exception it raised (the latest one).
        self.rank_errors: dict[int, RankFailure] = {}
        #: The agents' verdicts: only an agent decides that a rank failed for good.
        self.agent_failures: list[RankFailure] = []
        #: What training code reported with ``report()``, in arrival order.
        self.metrics: list[dict[str, Any]] = []
        self.started_nodes: set[int] = set()
        #: The host each started barrier task (node) runs on, as Spark's scheduler placed it.
        self.node_hosts: dict[int, str | None] = {}
        #: Ranks whose connection ended without a goodbye: (host, when). A rank killed by a signal
        #: cannot say so itself; this is how the driver still knows it died, and died first.
        self.vanished: dict[int, tuple[str | None, float]] = {}
        #: The node of each vanished rank, and the nodes whose agent reported (None: unknown).
        self._vanished_nodes: dict[int, int | None] = {}
        self._reporting_nodes: set[int] = set()
        self._first_problem: dict[int, float] = {}
        #: Task 0's rendezvous endpoint per generation (stage attempt).
        self._masters: dict[int, tuple[str, int]] = {}
        self._node_starts: dict[int, int] = {}
        self._closed = False

    def node_started(self, node: int, host: str | None) -> int:
        """A node's barrier task started; returns its generation (the n-th start is attempt n)."""
        with self._lock:
            generation = self._node_starts.get(node, 0)
            self._node_starts[node] = generation + 1
            self.started_nodes.add(node)
            self.node_hosts[node] = host
            return generation

    def rank_raised(self, rank: int, host: str | None, error: RankError, at: float | None = None) -> None:
        """A rank's own report of its exception (``at``: when, on the monotonic clock)."""
        with self._lock:
            self.rank_errors[rank] = error.failure(rank, host)
            self._first_problem.setdefault(rank, time.monotonic() if at is None else at)

    def rank_vanished(
        self, rank: int, host: str | None, at: float | None = None, node: int | None = None
    ) -> None:
        """A rank's connection ended without a goodbye: it may have died (``node``: its node)."""
        with self._lock:
            self.vanished.setdefault(rank, (host, time.monotonic() if at is None else at))
            self._vanished_nodes.setdefault(rank, node)

    def agents_failed(self, failures: Iterable[RankFailure], node: int | None = None) -> None:
        """An agent's verdict that its node (``node``) failed; wakes whoever waits for an endpoint."""
        with self._changed:
            self.agent_failures.extend(failures)
            if node is not None:
                self._reporting_nodes.add(node)
            self._changed.notify_all()

    def metric(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.metrics.append(record)

    def master_announced(self, generation: int, host: str, port: int) -> None:
        """Barrier task 0's rendezvous endpoint for ``generation`` (stage attempt)."""
        with self._changed:
            self._masters[generation] = (host, port)
            self._changed.notify_all()

    def wait_for_master(self, generation: int, timeout: float) -> MasterAnswer:
        """Task 0's endpoint for this generation, once reported; or why there will be none.

        The answer is an error when a node failed first, the run is closing, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while generation not in self._masters:
                left = deadline - time.monotonic()
                if self.agent_failures:
                    return MasterAnswer(error="another barrier task failed before the rendezvous")
                if self._closed:
                    return MasterAnswer(error="the driver is shutting down")
                if left <= 0:
                    return MasterAnswer(
                        error=f"barrier task 0 did not report its rendezvous endpoint within {timeout:.0f}s"
                    )
                self._changed.wait(left)
            host, port = self._masters[generation]
        return MasterAnswer(host=host, port=port)

    def close(self) -> None:
        """The run is ending: every ``wait_for_master`` returns now."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def failures(self) -> list[RankFailure]:
        """The failures that ended the run, root cause first: each agent's record filled in with the
        rank's own.

        Only an agent decides that a rank failed for good: with ``max_restarts`` a rank that raised
        may have been restarted and succeeded, so a rank's own error alone is not a failure.
        """
        with self._lock:
            if not self.agent_failures:
                return []
            merged: dict[int | None, RankFailure] = {}
            for i, failure in enumerate(self.agent_failures):
                own = self.rank_errors.get(failure.rank) if failure.rank is not None else None
                merged[failure.rank if failure.rank is not None else -1 - i] = (
                    own.merge(failure) if own else failure
                )
            # A rank that vanished without a word, while an agent blamed another: it died first (a
            # SIGKILL, maybe with its agent) and the blamed rank lost it. Unless it is that failure's
            # casualty: its own node's agent reported without naming it (torch ends a node's other
            # ranks when one fails), it vanished after the blamed ranks' trouble began, and none of
            # them failed over a lost peer.
            began = min((self._first_problem.get(r, float("inf")) for r in merged), default=float("inf"))
            lost_a_peer = any(_lost_a_peer(f) for f in merged.values())
            for rank, (host, at) in self.vanished.items():
                node = self._vanished_nodes.get(rank)
                reported = node is not None and node in self._reporting_nodes
                casualty = reported and at > began and not lost_a_peer
                if rank not in merged and rank not in self.rank_errors and not casualty:
                    merged[rank] = RankFailure(rank=rank, host=host, message=VANISHED_MESSAGE)
            first = {**{r: t for r, (_, t) in self.vanished.items()}, **self._first_problem}
            # Root cause first: the rank whose trouble started earliest, but a rank that failed over
            # a lost peer after every other (its error and the peer's death come from one instant,
            # and reach the driver in either order).
            return sorted(
                merged.values(),
                key=lambda f: (_lost_a_peer(f), first.get(f.rank, float("inf")), f.rank is None, f.rank or 0),
            )


def _lost_a_peer(failure: RankFailure) -> bool:
    """Whether the rank failed because a peer's connection went away (:data:`PEER_LOSS`)."""
    return failure.exc_type is not None and any(text in (failure.message or "") for text in PEER_LOSS)
