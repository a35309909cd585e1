"""The lifeline's handshake slots: how many connections may be authenticating at once, and from where.

A connection holds a slot from its accept until its handshake ends, at most ``HELLO_TIMEOUT_S``
(and ``HANDSHAKE_LINE_TIMEOUT_S`` per line it owes). Without limits, anyone who can connect could
hold every slot by connecting and saying nothing, and no owner would get in. So:

- a source is :func:`~.address.slot_source`'s: an IPv4 address, an IPv6 /64, all of loopback as
  one. While slots are free, anyone gets one. When all ``total`` are held, a newcomer from a
  source holding ``per_source`` or more takes the slot of one of that source's own connections
  (so a flood from an owner's own address cannot keep it out), and one from a source holding
  fewer takes one from a source holding more than its own (a busiest one's first);
- only a connection that has not *spoken* is taken: one whose hello line has arrived in full is
  never taken (an owner sends its hello at once, so a flood cannot push it out once its hello is
  here), but one source has at most ``per_source`` of those (another hello from it hears
  ``busy``). Silent connections go before those with part of a line, and among equals one is
  drawn at random (why: in :meth:`HandshakeSlots._quietest`). With none to take, the newcomer
  hears ``busy``; a connection whose slot is taken hears ``busy`` too (both clients try again on
  it), then is shut.

Local connections (source None: a unix socket, this user's processes only) share ``total`` alone.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
import threading
import time

from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused

_SILENT, _PARTIAL, _SPOKEN = 0, 1, 2


class HandshakeSlots:
    """Who is authenticating now (see the module docstring). Example::

    slots = HandshakeSlots(total=16, per_source=4, farewell=b'{"code": "busy", ...}\\n')
    if slots.admit("10.0.0.7", conn):
        hello = slots.hear_hello(conn, deadline, 4096)  # from now on its slot is never taken
        ...  # the rest of the handshake
        still_ours = slots.leave(conn)  # False: its slot was taken over (conn heard `farewell`)
    """

    def __init__(self, total: int, per_source: int, farewell: bytes = b"") -> None:
        if total < 1 or per_source < 1:
            raise ValueError(
                f"handshake slots need total >= 1 and per_source >= 1, got {total}, {per_source}"
            )
        self.total, self.per_source, self.farewell = total, per_source, farewell
        self._lock = threading.Lock()
        self._held: dict[socket.socket, str | None] = {}  # in the order they came
        self._by_source: dict[str, list[socket.socket]] = {}
        self._heard: set[socket.socket] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def admit(self, source: str | None, conn: socket.socket) -> bool:
        """Give ``conn`` (from ``source``) a slot; False when it gets none (it should hear ``busy``)."""
        with self._lock:
            if len(self._held) >= self.total:
                if source is None:
                    return False
                mine = self._by_source.get(source, [])
                if len(mine) >= self.per_source:  # one of its own source's makes room
                    victim = self._quietest({c: 0 for c in mine})
                else:  # one of a source holding more than its own
                    victim = self._quietest(self._of_busier_sources(len(mine)))
                if victim is None:
                    return False
                self._drop(victim)
                self._say_farewell(victim)
            self._held[conn] = source
            if source is not None:
                self._by_source.setdefault(source, []).append(conn)
            return True

    def hear_hello(self, conn: socket.socket, deadline: float, limit: int) -> bytes:
        """``conn``'s first line (its hello), read before ``deadline`` (monotonic) as
        :func:`~airflow_provider_torchdist.spark.wire.channel_auth.read_line` reads it. Once all of
        it has arrived, and before it is taken off the socket, ``conn`` is marked as having spoken:
        from then on no newcomer takes its slot. Raises :class:`HelloRefused` when the line is late,
        too long or cut off, or when ``conn``'s slot went to a newcomer first."""
        data = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HelloRefused("the hello took too long")
            conn.settimeout(left)
            try:
                chunk = conn.recv(limit + 1 - len(data), socket.MSG_PEEK)
            except TimeoutError:
                raise HelloRefused("the hello took too long") from None
            if not chunk:
                raise HelloRefused("the connection closed during the hello")
            end = chunk.find(b"\n")
            if end < 0:
                if len(data) + len(chunk) > limit:
                    raise HelloRefused("the hello is too long")
                data += conn.recv(len(chunk))  # part of a line: taken, so the next peek waits for more
                continue
            with self._lock:
                if conn not in self._held:
                    raise HelloRefused("its slot went to a newcomer")
                source = self._held[conn]
                if (
                    source is not None
                    and sum(c in self._heard for c in self._by_source[source]) >= self.per_source
                ):
                    self._say_farewell(conn)  # no source keeps more than its share out of reach
                    raise HelloRefused("its source has as many hellos in their handshake as it may")
                self._heard.add(conn)
            need = end + 1  # the rest of the line, here already: these reads do not wait
            while need:
                got = conn.recv(need)
                if not got:
                    raise HelloRefused("the connection closed during the hello")
                data += got
                need -= len(got)
            return bytes(data)

    def leave(self, conn: socket.socket) -> bool:
        """``conn``'s handshake ended: free its slot. False when it had lost it to a newcomer."""
        with self._lock:
            if conn not in self._held:
                return False
            self._drop(conn)
            return True

    def _of_busier_sources(self, holds: int) -> dict[socket.socket, int]:
        """The connections of sources holding more than ``holds`` slots, each ranked by how many
        fewer its source holds than the busiest (0: of a busiest source)."""
        counts = {c: len(self._by_source[s]) for c, s in self._held.items() if s is not None}
        most = max(counts.values(), default=0)
        return {c: most - n for c, n in counts.items() if n > holds}

    def _quietest(self, candidates: dict[socket.socket, int]) -> socket.socket | None:
        """One of ``candidates`` (connection: rank, lower first) that has not spoken: silent ones
        before those with part of a line, then by rank, then at random; None when all have spoken.

        At random, not the oldest: a flood that makes more connections than a source has slots
        within an owner's round trip would take the owner's slot, the oldest by then, every time;
        at random the owner keeps it on some of its tries."""
        ranked = [
            (level, rank, secrets.randbelow(1 << 30), conn)
            for conn, rank in candidates.items()
            if (level := self._level(conn)) != _SPOKEN
        ]
        return min(ranked, key=lambda entry: entry[:3])[3] if ranked else None

    def _level(self, conn: socket.socket) -> int:
        """How far ``conn`` got with its hello, from what waits on the socket (nothing read)."""
        if conn in self._heard:
            return _SPOKEN
        try:
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            if not poller.poll(0):
                return _SILENT
            # Readable: this peek returns at once (and an end of stream or an error, b"").
            pending = conn.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return _SILENT
        return _SPOKEN if b"\n" in pending else (_PARTIAL if pending else _SILENT)

    def _say_farewell(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):  # never waits: it has said nothing, so nothing is queued
            if self.farewell:
                conn.send(self.farewell, socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):  # its handshake fails at once and its thread ends
            conn.shutdown(socket.SHUT_RDWR)

    def _drop(self, conn: socket.socket) -> None:
        source = self._held.pop(conn)
        self._heard.discard(conn)
        if source is not None:
            held = self._by_source[source]
            held.remove(conn)
            if not held:
                del self._by_source[source]
