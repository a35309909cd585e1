"""The lifeline's handshake slots: how many connections may be authenticating at once, and from where.

A connection holds a slot from its accept until its handshake ends, at most ``HELLO_TIMEOUT_S``
(and ``HANDSHAKE_LINE_TIMEOUT_S`` per line it owes). Without per-source limits, anyone who can
connect could hold every slot by connecting and saying nothing, and no owner would get in. So:

- one source (a TCP peer's address) holds at most ``per_source`` slots;
- when all ``total`` are held, a newcomer from a source holding fewer than the busiest source takes
  the slot of that source's oldest connection, which is closed. To keep a newcomer out, a flood
  must come from as many sources as there are slots, each holding no more than the newcomer's own.

Local connections (source None: a unix socket, this user's processes only) share ``total`` alone.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class HandshakeSlots:
    """Who is authenticating now (see the module docstring). Example::

    slots = HandshakeSlots(total=16, per_source=4)
    if slots.admit("10.0.0.7", conn):
        ...  # the handshake
        still_ours = slots.leave(conn)  # False: its slot was taken over (conn was closed)
    """

    def __init__(self, total: int, per_source: int) -> None:
        if total < 1 or per_source < 1:
            raise ValueError(
                f"handshake slots need total >= 1 and per_source >= 1, got {total}, {per_source}"
            )
        self.total, self.per_source = total, per_source
        self._lock = threading.Lock()
        self._held: dict[socket.socket, str | None] = {}  # in the order they came
        self._by_source: dict[str, list[socket.socket]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def admit(self, source: str | None, conn: socket.socket) -> bool:
        """Give ``conn`` (from ``source``) a slot; False when it gets none (it should hear ``busy``)."""
        with self._lock:
            mine = len(self._by_source.get(source, ())) if source is not None else 0
            if source is not None and mine >= self.per_source:
                return False
            if len(self._held) >= self.total:
                victim = self._busiest_oldest(mine) if source is not None else None
                if victim is None:
                    return False
                self._drop(victim)
                with contextlib.suppress(OSError):  # its handshake fails at once and its thread ends
                    victim.shutdown(socket.SHUT_RDWR)
            self._held[conn] = source
            if source is not None:
                self._by_source.setdefault(source, []).append(conn)
            return True

    def leave(self, conn: socket.socket) -> bool:
        """``conn``'s handshake ended: free its slot. False when it had lost it to a newcomer."""
        with self._lock:
            if conn not in self._held:
                return False
            self._drop(conn)
            return True

    def _busiest_oldest(self, newcomer_holds: int) -> socket.socket | None:
        """The oldest connection of a source holding the most slots, if more than the newcomer's."""
        most = max(map(len, self._by_source.values()), default=0)
        if most <= newcomer_holds:
            return None
        return next(c for c, s in self._held.items() if s is not None and len(self._by_source[s]) == most)

    def _drop(self, conn: socket.socket) -> None:
        source = self._held.pop(conn)
        if source is not None:
            held = self._by_source[source]
            held.remove(conn)
            if not held:
                del self._by_source[source]
