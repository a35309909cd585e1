"""The supervisor's lifeline: :class:`LifelineServer` accepts connections, runs the supervisor's
half of the handshake, answers ``status`` queries and hands each owner to an
:class:`~airflow_provider_torchdist.supervision.lifeline.session.OwnerSession`."""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import threading
import time
from typing import Any

from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused, read_line
from airflow_provider_torchdist.supervision.lifeline.handshake import (
    _NONCE,
    _check_run_id,
    _check_secret,
    owner_proof,
    status_digest,
    supervisor_proof,
)
from airflow_provider_torchdist.supervision.lifeline.messages import (
    HELLO_TIMEOUT_S,
    KINDS,
    LIFELINE_VERSION,
    MAX_PENDING_HELLOS,
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
from airflow_provider_torchdist.supervision.lifeline.session import OwnerListener, OwnerSession, _AnyOwner

_MAX_HELLO_BYTES = 4096


class LifelineServer:
    """The supervisor's lifeline: binds ``bind_host`` on a free port at once; :meth:`start` serves.

    Authenticates every connection (both ways), answers ``status`` queries, and streams ``state``
    to owners; what owners do goes to ``listener``. Example::

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
    ) -> None:
        self.run_id = _check_run_id(run_id)
        self._secret = _check_secret(secret)
        self.state = state if state is not None else RunState()
        self.listener: OwnerListener = listener if listener is not None else _AnyOwner()
        self.silence_s, self.ping_interval, self.hello_timeout = silence_s, ping_interval, hello_timeout
        family = socket.getaddrinfo(bind_host, 0, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((bind_host, 0), family=family)
        self._sock.settimeout(0.25)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._pending = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._sessions: set[OwnerSession] = set()
        self._connections: set[socket.socket] = set()
        self._accepting = True
        self._close_reason = "the supervisor is closing"
        self._thread = threading.Thread(target=self._accept_loop, name="torchdist-lifeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """From now on a new connection is refused (an owner is told the run is gone)."""
        with self._lock:
            self._accepting = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

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
            if not self._pending.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(
                        encode(
                            {"error": "too many connections are authenticating; try again", "code": "busy"}
                        )
                    )
                conn.close()
                continue
            with self._lock:
                if not self._accepting:
                    self._pending.release()
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve,
                args=(conn, f"{peer[0]}:{peer[1]}"),
                name="torchdist-lifeline-conn",
                daemon=True,
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            try:
                hello = self._handshake(conn)
            finally:
                self._pending.release()
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

        def receive() -> dict[str, Any]:
            return decode(read_line(conn, deadline, _MAX_HELLO_BYTES))

        try:
            hello = receive()
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
                self._refuse(conn, f"this supervisor runs run {self.run_id}, not {run_id}", "wrong_run")
                return None
            server_nonce = secrets.token_hex(16)
            conn.sendall(encode({"nonce": server_nonce}))
            answer = receive()
            _exact_keys(answer, {"proof"}, "malformed proof")
            expected = owner_proof(self._secret, run_id, kind, server_nonce, client_nonce)
            if not isinstance(answer["proof"], str) or not hmac.compare_digest(answer["proof"], expected):
                self._refuse(conn, "the owner's credentials were refused", "refused")
                return None
        except MalformedMessage as exc:
            self._refuse(conn, str(exc), "malformed")
            return None
        except HelloRefused:
            return None
        return kind, since, client_nonce, server_nonce

    def _welcome(self, status: dict[str, Any], client_nonce: str, server_nonce: str) -> bytes:
        """The handshake's last message: this supervisor's proof, bound to the status it carries."""
        proof = supervisor_proof(self._secret, self.run_id, client_nonce, server_nonce, status_digest(status))
        return encode({"ok": True, "proof": proof, "status": status})

    def _own(self, conn: socket.socket, peer: str, hello: tuple[str, int, str, str]) -> None:
        kind, since, client_nonce, server_nonce = hello
        if kind == "status":
            conn.sendall(self._welcome(self.state.status().to_dict(), client_nonce, server_nonce))
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            return
        status, sub = self.state.subscribe(since)
        session = OwnerSession(self, conn, kind, peer, sub)
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
                conn.sendall(welcome + encode({"k": "closing", "reason": self._close_reason}))
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
