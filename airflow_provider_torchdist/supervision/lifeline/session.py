"""One owner on the supervisor's side: :class:`OwnerSession` (it sends the owner its events and
reads its commands) and :class:`OwnerListener`, what the supervisor hears about its owners."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from typing import TYPE_CHECKING, BinaryIO, Protocol

from airflow_provider_torchdist.supervision.lifeline.events import parse_command
from airflow_provider_torchdist.supervision.lifeline.messages import MalformedMessage, encode
from airflow_provider_torchdist.supervision.lifeline.output import send_output
from airflow_provider_torchdist.supervision.lifeline.run_state import _Raw, _Subscription
from airflow_provider_torchdist.supervision.lifeline.sealed import Opener, Sealer, StreamTampered

if TYPE_CHECKING:
    from airflow_provider_torchdist.supervision.lifeline.server import LifelineServer


class OwnerListener(Protocol):
    """What the supervisor hears from the lifeline about its owners (called from server threads)."""

    def owner_attached(self, owner: OwnerSession) -> None: ...

    def owner_command(self, owner: OwnerSession, command: str, why: str | None = None) -> str | None:
        """``stop`` (``why``: the owner's reason, such as "timeout"), ``detach`` or ``release``; a
        returned text is sent back as an error."""
        ...

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        """The session ended (closed, broke, silent, or closed by the supervisor); once per session."""
        ...


class _AnyOwner:
    """The listener of a server nobody supervises (tests of the protocol): every command is fine."""

    def owner_attached(self, owner: OwnerSession) -> None:
        pass

    def owner_command(self, owner: OwnerSession, command: str, why: str | None = None) -> str | None:
        return None

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        pass


class OwnerSession:
    """One authenticated owner connection, on the supervisor's side.

    Its own thread sends the subscription's events (and pings when idle); the connection's thread
    reads the owner's commands. ``close(reason)`` sends what is queued, then ``closing``, then closes.
    Both directions are sealed (:mod:`.sealed`): ``sealer`` seals what this session sends (the
    subscription's messages are encoded once for all owners; each session adds its own MAC as it
    sends them), ``opener`` checks the owner's commands.
    """

    def __init__(
        self,
        server: LifelineServer,
        sock: socket.socket,
        kind: str,
        peer: str,
        sub: _Subscription,
        sealer: Sealer,
        opener: Opener,
    ) -> None:
        self.kind = kind
        self.peer = peer
        self.detached = False
        self._server = server
        self._sock = sock
        self._sub = sub
        self._sealer, self._opener = sealer, opener
        self._closing: str | None = None
        self._writer = threading.Thread(target=self._write_loop, name="torchdist-lifeline-send", daemon=True)

    def __repr__(self) -> str:
        return f"<owner {self.kind} from {self.peer}>"

    def send_error(self, message: str) -> None:
        self._sub.items.put(_Raw(encode({"k": "error", "message": message})))

    def close(self, reason: str) -> None:
        """Send what is queued and ``{"k": "closing", "reason": reason}``, then close the connection."""
        if self._closing is None:
            self._closing = reason
            self._sub.items.put(_Subscription.CLOSE)

    def fetch(self) -> None:
        self._sub.items.put(_Subscription.FETCH)

    def start_sending(self) -> None:
        """Start the thread that sends this owner its events."""
        self._writer.start()

    def wait_sent(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until the sending thread is done, after :meth:`close`."""
        if self._writer.ident is not None:
            self._writer.join(timeout)

    def _write_loop(self) -> None:
        # The only thread that sends after the welcome: the sealer's numbers follow the sends.
        sock, sub, seal = self._sock, self._sub, self._sealer.seal
        try:
            while True:
                try:
                    item = sub.items.get(timeout=self._server.ping_interval)
                except queue.Empty:
                    sock.sendall(seal(encode({"k": "ping"})))
                    continue
                if item is _Subscription.CLOSE:
                    sock.sendall(seal(encode({"k": "closing", "reason": self._closing or "closed"})))
                    return
                if item is _Subscription.FETCH:
                    send_output(self._sock, self._sealer, *self._server.state.output())
                elif isinstance(item, _Raw):
                    sock.sendall(seal(item.data))
                else:
                    dropped = sub.took()
                    if dropped:
                        notice = f"{dropped} event(s) were not sent: this owner fell behind"
                        sock.sendall(seal(encode({"k": "error", "message": notice})))
                    sock.sendall(seal(item))
        except OSError:
            pass  # gone, or stalled past the timeout: the reader sees the connection end
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def read_commands(self, reader: BinaryIO) -> str:
        """Read commands until the owner is gone; returns why it is."""
        listener = self._server.listener
        while True:
            try:
                msg = self._opener.read(reader)
            except TimeoutError:
                return f"it sent nothing for {self._server.silence_s:g} s"
            except StreamTampered as exc:
                self.close("what came from the owner was tampered with on the way")
                return str(exc)
            except MalformedMessage as exc:
                self.close(f"a malformed message: {exc}")
                return f"it sent a malformed message ({exc})"
            except (OSError, ValueError) as exc:
                return self._why_closed(f"its connection broke ({exc})")
            if msg is None:
                return self._why_closed("it closed the connection")
            try:
                command, why = parse_command(msg)
            except MalformedMessage as exc:
                self.send_error(str(exc))
                continue
            if command == "ping":
                continue
            if command == "fetch":
                if not self._server.state.ended:
                    self.send_error("the run has not ended: its output is fetched after 'done'")
                else:
                    self.fetch()
                continue
            if command == "detach":
                self.detached = True
            error = listener.owner_command(self, command, why)
            if error:
                self.send_error(error)

    def _why_closed(self, default: str) -> str:
        return f"the supervisor closed it ({self._closing})" if self._closing else default
