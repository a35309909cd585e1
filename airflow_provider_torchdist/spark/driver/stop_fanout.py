"""The driver's side of a graceful stop: the stop request goes to every rank, and their answers
come back (:mod:`~airflow_provider_torchdist.spark.node.stop` is the rank's side).

:class:`StopFanout` knows the ranks connected now. When the stopper asks (``stop-request.json`` in
the staging directory, :mod:`~airflow_provider_torchdist.spark.wire.stop_request`), it sends each of
them a :class:`~airflow_provider_torchdist.spark.wire.protocol.StopRequest`, and one to every rank
that connects later (a restarted worker group). Each rank answers whether its code watches for
stops; once every connected rank has answered and none does, it writes ``stop-declined`` for the
stopper, which then ends the run at once instead of waiting out its grace period.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

from airflow_provider_torchdist.spark.wire import protocol as wire
from airflow_provider_torchdist.spark.wire.stop_request import read_stop_request, write_stop_declined

#: How often the driver looks for a stop request in the staging directory.
STOP_POLL_S = 0.1


class StopFanout:
    """The run's stop, as the driver relays it (see the module docstring). Thread-safe.

    ``say`` prints a line of the driver's own in the task log.
    """

    def __init__(self, staging_dir: Path, say: Callable[[str], None]) -> None:
        self._dir = staging_dir
        self._say = say
        self._lock = threading.Lock()
        self._ranks: dict[socket.socket, int] = {}
        #: The stop once asked for, and each rank's answer: whether its code watches for stops.
        self.request: wire.StopRequest | None = None
        self.answers: dict[int, bool] = {}
        #: Set once every connected rank answered and none watches for stops.
        self.declined = threading.Event()
        #: Whether the stopper asked (it then waits on ``stop-declined``), besides or instead of the
        #: driver itself (a decommissioned node: :mod:`.decommission`). The stopper's stop stands:
        #: it is never withdrawn.
        self.stopper_asked = False
        #: How many ranks the request went to when it was made.
        self.sent_to = 0
        self._closed = threading.Event()

    def watch(self) -> None:
        """Poll the staging directory for the stopper's request, until :meth:`close`."""

        def poll() -> None:
            while not self._closed.wait(STOP_POLL_S):
                request = read_stop_request(self._dir)
                if request is not None:
                    self.stop(request.reason, request.grace, from_stopper=True)
                    return

        threading.Thread(target=poll, name="torchdist-stop-watch", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def stop(
        self,
        reason: str,
        grace: float,
        from_stopper: bool = False,
        before_sending: Callable[[int], None] | None = None,
    ) -> bool:
        """Ask every rank, connected now or later, to checkpoint and return within ``grace`` seconds;
        False when already asked (the first request stands, and the ranks are stopping already).
        ``from_stopper``: the request came from the stop-request file; its stopper is told when no
        rank watches, and its stop is never withdrawn, even when it came second.
        ``before_sending``: called with the count of ranks it goes to, for a first request, before
        any rank has it (what the run's end reads must be in place before the ranks can return)."""
        request = wire.StopRequest(reason, grace)
        with self._lock:
            if from_stopper:
                self.stopper_asked = True
            first = self.request is None
            if first:
                self.sent_to = len(self._ranks)
                if before_sending is not None:
                    before_sending(self.sent_to)
                self.request = request
            ranks = list(self._ranks)
            tell_stopper = from_stopper and self.declined.is_set()
        if tell_stopper:
            write_stop_declined(self._dir, len(self.answers))
        if not first:
            return False
        self._say(f"the stop request ({reason}) goes to {len(ranks)} rank(s)")
        for sock in ranks:
            _send(sock, request)
        return True

    def withdraw(self) -> bool:
        """Forget the driver's own request and its answers: an elastic run's worker group that meets
        again after a node left (:mod:`.decommission`) trains on, and a later request is sent as a
        first one. False, withdrawing nothing, once the stopper has asked: its stop stands."""
        with self._lock:
            if self.stopper_asked:
                return False
            self.request = None
            self.answers = {}
            self.declined.clear()
            return True

    def rank_connected(self, sock: socket.socket, rank: int) -> None:
        """A verified rank's connection: it gets the stop, now if one was asked for already."""
        with self._lock:
            self._ranks[sock] = rank
            request = self.request
        if request is not None:
            _send(sock, request)

    def rank_gone(self, sock: socket.socket) -> None:
        with self._lock:
            self._ranks.pop(sock, None)

    def answered(self, rank: int, watching: bool) -> None:
        """A rank's answer; once every connected rank has answered and none watches, the stopper
        is told (``stop-declined``): a grace period would save nothing."""
        with self._lock:
            if self.request is None or rank in self.answers:
                return
            self.answers[rank] = watching
            declined = not any(self.answers.values()) and set(self._ranks.values()) <= set(self.answers)
            to_stopper = declined and self.stopper_asked
        if declined:
            self.declined.set()
        if to_stopper:
            write_stop_declined(self._dir, len(self.answers))
            self._say(
                "no rank's code watches for stops (stop_requested() was never asked, no handler of its "
                "own for the stop signal): the run is ended now, not after its grace period"
            )


def _send(sock: socket.socket, request: wire.StopRequest) -> None:
    try:
        sock.sendall(wire.encode(request))
    except OSError:
        pass  # the rank is gone already: nothing left of it to stop
