"""The supervisor's lifeline: :class:`LifelineServer` accepts connections, runs the supervisor's
half of the handshake, answers ``status`` queries and hands each owner to an
:class:`~airflow_provider_torchdist.supervision.lifeline.session.OwnerSession`."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from typing import Any

from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused, read_line
from airflow_provider_torchdist.supervision.lifeline.address import listen_lifeline, peer_source, unix_path
from airflow_provider_torchdist.supervision.lifeline.credentials import STATUS_ONLY, proved_kind
from airflow_provider_torchdist.supervision.lifeline.handshake import (
    _NONCE,
    _check_run_id,
    _check_secret,
    status_digest,
    supervisor_proof,
)
from airflow_provider_torchdist.supervision.lifeline.messages import (
    HANDSHAKE_LINE_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    KINDS,
    LIFELINE_VERSION,
    MAX_PENDING_HELLOS,
    MAX_PENDING_PER_SOURCE,
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    MalformedMessage,
    _exact_keys,
    _is_int,
    _require,
    decode,
    encode,
)
from airflow_provider_torchdist.supervision.lifeline.run_state import RunState
from airflow_provider_torchdist.supervision.lifeline.sealed import supervisor_stream
from airflow_provider_torchdist.supervision.lifeline.session import OwnerListener, OwnerSession, _AnyOwner
from airflow_provider_torchdist.supervision.lifeline.slots import HandshakeSlots

_MAX_HELLO_BYTES = 4096
_BUSY = {"error": "too many connections are authenticating; try again", "code": "busy"}


class LifelineServer:
    """The supervisor's lifeline: binds ``bind_host`` on a free port (or the ``unix:<path>`` it
    names) at once; :meth:`start` serves.

    Authenticates every connection (both ways), answers ``status`` queries, and streams ``state``
    to owners; what owners do goes to ``listener``. A connection in its handshake holds one of
    ``max_pending`` slots, at most ``max_per_source`` from one TCP source, and owes each line within
    ``line_timeout`` (:mod:`.slots`); on a unix socket only this user's processes get one. Example::

        server = LifelineServer(run_id, secret, "127.0.0.1", state, supervisor)
        host, port = server.address
        server.start()
        ...
        server.close("the run was torn down")
    """

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        bind_host: str,
        state: RunState | None = None,
        listener: OwnerListener | None = None,
        *,
        silence_s: float = OWNER_SILENCE_S,
        ping_interval: float = PING_INTERVAL_S,
        hello_timeout: float = HELLO_TIMEOUT_S,
        max_pending: int = MAX_PENDING_HELLOS,
        max_per_source: int = MAX_PENDING_PER_SOURCE,
        line_timeout: float = HANDSHAKE_LINE_TIMEOUT_S,
        status_secret: bytes | None = None,  # for `status` queries only (.credentials)
    ) -> None:
        self.run_id = _check_run_id(run_id)
        self._secret = _check_secret(secret)
        self._status_secret = None if status_secret is None else _check_secret(status_secret)
        self.state = state if state is not None else RunState()
        self.listener: OwnerListener = listener if listener is not None else _AnyOwner()
        self.silence_s, self.ping_interval, self.hello_timeout = silence_s, ping_interval, hello_timeout
        self.line_timeout = line_timeout
        self._sock, self.address = listen_lifeline(bind_host)
        self._sock.settimeout(0.25)
        self._unix_path = unix_path(self.address[0])
        self._slots = HandshakeSlots(max_pending, max_per_source, farewell=encode(_BUSY))
        self._lock = threading.Lock()
        self._sessions: set[OwnerSession] = set()
        self._connections: set[socket.socket] = set()
        self._accepting = True
        self._close_reason = "the supervisor is closing"
        self._thread = threading.Thread(target=self._accept_loop, name="torchdist-lifeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def pending(self) -> int:
        """How many connections are in their handshake now (each holds one of ``max_pending``)."""
        return len(self._slots)

    def stop_accepting(self) -> None:
        """From now on a new connection is refused (an owner is told the run is gone)."""
        with self._lock:
            self._accepting = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)  # a new owner finds nothing there: the run is gone

    def close(self, reason: str, timeout: float = 2.0) -> None:
        """Stop accepting; every owner gets what is queued and ``closing`` (up to ``timeout``)."""
        self._close_reason = reason
        self.stop_accepting()
        with self._lock:
            sessions, connections = list(self._sessions), list(self._connections)
        for session in sessions:
            session.close(reason)
        deadline = time.monotonic() + timeout
        for session in sessions:
            session.wait_sent(max(0.0, deadline - time.monotonic()))
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            source, peer_text = peer_source(conn, peer)
            if source == "":  # a unix peer of another user (root aside, the directory keeps them out)
                self._answer_now(conn, {"error": "this lifeline is its user's only", "code": "refused"})
                continue
            if not self._slots.admit(source, conn):  # turned away without taking a slot
                self._answer_now(conn, _BUSY)
                continue
            with self._lock:
                if not self._accepting:
                    self._slots.leave(conn)
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve,
                args=(conn, peer_text),
                name="torchdist-lifeline-conn",
                daemon=True,
            ).start()

    @staticmethod
    def _answer_now(conn: socket.socket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(encode(msg))
        conn.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            try:
                hello = self._handshake(conn)
            finally:
                if not self._slots.leave(conn):
                    hello = None  # a newcomer took its slot: closed mid-handshake, nothing more
            if hello is not None:
                self._own(conn, peer, hello)
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _refuse(self, conn: socket.socket, error: str, code: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(encode({"error": error, "code": code}))

    def _handshake(self, conn: socket.socket) -> tuple[str, int, str, str] | None:
        """``(kind, since, client nonce, server nonce)`` for an authenticated client; None after a
        refusal."""
        deadline = time.monotonic() + self.hello_timeout

        def receive(first: bool = False) -> dict[str, Any]:
            # Each line the owner owes is due soon (it sends it at once), all of them by the deadline.
            line_deadline = min(deadline, time.monotonic() + self.line_timeout)
            # The first, its hello, through the slots: once it is here, no newcomer takes its slot.
            read = self._slots.hear_hello if first else read_line
            return decode(read(conn, line_deadline, _MAX_HELLO_BYTES))

        try:
            hello = receive(first=True)
            version = hello.get("v")
            if not _is_int(version) or version != LIFELINE_VERSION:
                self._refuse(
                    conn,
                    f"this supervisor speaks lifeline version {LIFELINE_VERSION}, the client {version!r}: owner and "
                    "supervisor come from different airflow-provider-torchdist versions",
                    "version",
                )
                return None
            _exact_keys(hello, {"v", "run_id", "kind", "since", "nonce"}, "malformed hello")
            run_id, kind, since, client_nonce = hello["run_id"], hello["kind"], hello["since"], hello["nonce"]
            _require(isinstance(run_id, str) and bool(run_id), "malformed hello: bad run_id")
            _require(kind in KINDS, f"malformed hello: kind must be one of {', '.join(KINDS)}")
            _require(_is_int(since) and since >= 0, "malformed hello: bad since")
            _require(
                isinstance(client_nonce, str) and bool(_NONCE.fullmatch(client_nonce)),
                "malformed hello: bad nonce",
            )
            if run_id != self.run_id:
                # Not which run: whoever asks has proved nothing yet (an owner of the asked-for run
                # only needs to know that its supervisor is not here).
                self._refuse(conn, f"this supervisor runs another run, not {run_id}", "wrong_run")
                return None
            server_nonce = secrets.token_hex(16)
            conn.sendall(encode({"nonce": server_nonce}))
            answer = receive()
            _exact_keys(answer, {"proof"}, "malformed proof")
            nonces, secrets_ = (server_nonce, client_nonce), (self._secret, self._status_secret)
            if (kind := proved_kind(answer["proof"], run_id, kind, nonces, *secrets_)) is None:
                self._refuse(conn, "the owner's credentials were refused", "refused")
                return None
        except MalformedMessage as exc:
            self._refuse(conn, str(exc), "malformed")
            return None
        except HelloRefused:
            return None
        return kind, since, client_nonce, server_nonce

    def _welcome(self, status: dict[str, Any], client_nonce: str, server_nonce: str, kind: str = "") -> bytes:
        """The handshake's last message: this supervisor's proof, bound to the status it carries
        (under the status credential for a query that proved that one: :mod:`.credentials`)."""
        key, digest = self._status_secret if kind == STATUS_ONLY else self._secret, status_digest(status)
        proof = supervisor_proof(key, self.run_id, client_nonce, server_nonce, digest)
        return encode({"ok": True, "proof": proof, "status": status})

    def _own(self, conn: socket.socket, peer: str, hello: tuple[str, int, str, str]) -> None:
        kind, since, client_nonce, server_nonce = hello
        if kind in ("status", STATUS_ONLY):
            conn.sendall(self._welcome(self.state.status().to_dict(), client_nonce, server_nonce, kind))
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            return
        status, sub = self.state.subscribe(since)
        sealer, opener = supervisor_stream(self._secret, self.run_id, client_nonce, server_nonce, peer)
        session = OwnerSession(self, conn, kind, peer, sub, sealer, opener)
        try:
            conn.settimeout(self.silence_s)
            welcome = self._welcome(status.to_dict(), client_nonce, server_nonce)
            # The welcome and the session's registration are one step for close(): an owner that
            # has its welcome is always among the sessions close() sends "closing" to.
            with self._lock:
                accepting = self._accepting
                if accepting:
                    conn.sendall(welcome)
                    self._sessions.add(session)
                    session.start_sending()
            if not accepting:  # closed during the handshake
                conn.sendall(welcome + sealer.seal(encode({"k": "closing", "reason": self._close_reason})))
                return
            reader = conn.makefile("rb")
            why = "it never got going"
            try:
                self.listener.owner_attached(session)
                why = session.read_commands(reader)
            finally:
                session.close(why)
                session.wait_sent(self.silence_s)
                reader.close()
                self.listener.owner_lost(session, why)
        finally:
            self.state.unsubscribe(sub)
            with self._lock:
                self._sessions.discard(session)
