"""A rank's or a node's agent's end of the run channel (the driver's end is :mod:`.channel`)."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.wire.channel_auth import (
    HELLO_TIMEOUT_S,
    PROTOCOL_VERSION,
    ChannelRefused,
    HelloRefused,
    rank_proof,
    read_json,
    send_json,
)
from airflow_provider_torchdist.spark.wire.node_claims import claim_proof, wrap_key
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import (
    AgentFailures,
    Bye,
    Line,
    MasterAnswer,
    MasterEndpoint,
    MasterQuery,
    Message,
    Output,
    OutputFile,
    RankError,
    decode,
    encode,
)

#: The longest message the driver pushes to a rank (a stop request is under 300 bytes).
MAX_PUSH_BYTES = 64 * 1024


class ChannelClient:
    """A rank's or agent's end of the run channel. Thread-safe; never raises after connecting.

    When the connection breaks, ``broken`` holds why and sends become no-ops, so callers can fall
    back to local output and say so.
    """

    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        hello: dict[str, Any],
        node_key: bytes | None = None,
        claim_secret: bytes | None = None,
    ) -> None:
        """Connect and prove who this is; use :meth:`as_node` or :meth:`as_rank`.

        Raises :class:`ChannelRefused` (a ``ConnectionError``) when the driver does not accept it.
        """
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.node_key = node_key
        #: An elastic run's key for its rendezvous state, from the driver (None for a rank).
        self.elastic_key: bytes | None = None
        #: A node's host as Spark's scheduler runs it, from the driver (None for a rank).
        self.host: str | None = None
        self._sock = socket.create_connection(tuple(address), timeout=HELLO_TIMEOUT_S)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            send_json(self._sock, {"v": PROTOCOL_VERSION, "token": token, **hello})
            reply = read_json(self._sock, deadline)
            nonce = str(reply.get("nonce", ""))
            if "nonce" in reply:
                send_json(self._sock, {"proof": self._proof(hello, nonce, node_key, claim_secret)})
                reply = read_json(self._sock, deadline)
            if "key" in reply:
                # Wrapped under this node's claim secret where it proved one.
                self.node_key = _unwrapped(reply, "key", claim_secret, nonce)
                if reply.get("elastic_key"):
                    self.elastic_key = _unwrapped(reply, "elastic_key", claim_secret, nonce)
                host = reply.get("host")
                self.host = host if isinstance(host, str) and host else None
            elif reply.get("ok") is not True:
                raise ChannelRefused(f"the driver refused this connection: {reply.get('error', reply)}")
        except (HelloRefused, OSError, ValueError) as exc:
            self._sock.close()
            if isinstance(exc, ChannelRefused):
                raise
            raise ChannelRefused(f"the hello with the driver failed: {exc}") from None
        self._sock.settimeout(None)

    @staticmethod
    def _proof(hello: dict[str, Any], nonce: str, node_key: bytes | None, claim_secret: bytes | None) -> str:
        """The answer to the driver's challenge: a rank's with its node key, a node's with its claim secret."""
        if hello["role"] == "rank" and node_key is not None:
            return rank_proof(node_key, nonce, hello)
        if hello["role"] == "node" and claim_secret is not None:
            return claim_proof(claim_secret, nonce, hello)
        raise ChannelRefused(
            "the driver asks this node to prove its claim, and its task carries no claim secret: the "
            "driver and the executors run different versions of the provider"
        )

    @classmethod
    def as_node(
        cls,
        address: tuple[str, int],
        token: str,
        *,
        node: int,
        task_attempt: int,
        host: str | None,
        claim_secret: bytes | None = None,
    ) -> ChannelClient:
        """A task's agent: Spark's scheduler vouches for it, or (``claim_secret``, over Spark
        Connect) it proves it holds its node's own claim secret; it gets its node key."""
        hello = {"role": "node", "node": node, "task": task_attempt, "host": host}
        return cls(address, token, hello, claim_secret=claim_secret)

    @classmethod
    def as_rank(
        cls,
        address: tuple[str, int],
        token: str,
        *,
        node: int,
        rank: int,
        generation: int,
        host: str | None,
        node_key: bytes,
    ) -> ChannelClient:
        """A rank: proves with its node's key that it is one of that node's ranks."""
        hello = {"role": "rank", "node": node, "rank": rank, "generation": generation, "host": host}
        return cls(address, token, hello, node_key)

    def _send_raw(self, *parts: bytes | memoryview) -> bool:
        with self._lock:
            if self.broken:
                return False
            try:
                for part in parts:
                    self._sock.sendall(part)
                return True
            except OSError as exc:
                self.broken = repr(exc)
                return False

    def send(self, msg: Message) -> bool:
        """Send one message; False (and ``broken`` says why) when the connection is down."""
        return self._send_raw(encode(msg))

    def line(self, stream: str, text: str) -> bool:
        return self.send(Line(stream, text))

    def error(self, failure: dict[str, Any]) -> bool:
        """A rank's own exception: the :class:`RankError` fields (``exc_type``, ``message``, ...)."""
        return self.send(RankError(**failure))

    def failures(self, failures: list[RankFailure]) -> bool:
        return self.send(AgentFailures(tuple(failures)))

    def announce_master(self, host: str, port: int) -> bool:
        """Barrier task 0's agent (after its ``node`` message): the rendezvous endpoint for the other tasks."""
        return self.send(MasterEndpoint(host, port))

    def wait_for_master(self, timeout: float) -> tuple[str, int]:
        """Another barrier task (after its ``node`` message): ask the driver for task 0's endpoint.

        Waits until the driver has it. Raises ``RuntimeError`` when the driver cannot tell (a node
        failed first, the wait timed out).
        """
        if not self.send(MasterQuery(timeout)):
            raise RuntimeError(f"the run channel to the driver broke: {self.broken}")
        reply = b""
        with self._lock:
            self._sock.settimeout(timeout + 30)
            try:
                while not reply.endswith(b"\n"):
                    chunk = self._sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
            except OSError as exc:
                raise RuntimeError(f"no rendezvous endpoint from the driver: {exc!r}") from None
            finally:
                self._sock.settimeout(None)
        try:
            answer = decode(reply)
        except ValueError:
            raise RuntimeError(
                "the driver closed the run channel before it sent the rendezvous endpoint"
            ) from None
        if not isinstance(answer, MasterAnswer):
            raise RuntimeError(f"the driver answered the rendezvous query with a {answer.KIND!r} message")
        if answer.error is not None or answer.host is None or answer.port is None:
            raise RuntimeError(f"no rendezvous endpoint: {answer.error}")
        return answer.host, answer.port

    def output(self, data: bytes, **meta: Any) -> bool:
        """Send rank 0's encoded value (``meta``: its ``format``, ``type`` and ``sha256``)."""
        return self._send_raw(encode(Output(len(data), **meta)), memoryview(data))

    def output_file(self, path: str, **meta: Any) -> bool:
        """Stream an encoded output from a file: the bytes never sit in this process's memory."""
        with open(path, "rb") as f:
            header = encode(Output(os.fstat(f.fileno()).st_size, **meta))
            with self._lock:
                if self.broken:
                    return False
                try:
                    self._sock.sendall(header)
                    self._sock.sendfile(f)
                    return True
                except OSError as exc:
                    self.broken = repr(exc)
                    return False

    def output_in_place(self, name: str, **meta: Any) -> bool:
        """Tell the driver that the output is the file ``name`` written into its output directory."""
        return self.send(OutputFile(name, **meta))

    def listen(self, on_message: Callable[[Message], None]) -> None:
        """Hand each message the driver sends on this connection (a rank's: a
        :class:`~airflow_provider_torchdist.spark.wire.protocol.StopRequest`) to ``on_message``,
        from a thread of its own, until the connection ends. Use it only where nothing else reads
        (a rank's connection: its sends are never answered)."""

        def read() -> None:
            buffer = b""
            while True:
                try:
                    chunk = self._sock.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                buffer += chunk
                if len(buffer) > MAX_PUSH_BYTES:
                    return  # not a message this side expects: stop listening, keep sending
                while b"\n" in buffer:
                    raw, buffer = buffer.split(b"\n", 1)
                    try:
                        message = decode(raw)
                    except ValueError:
                        return
                    on_message(message)

        threading.Thread(target=read, daemon=True, name="torchdist-driver-listen").start()

    def watch_driver(self, on_lost: Callable[[], None], every: float = 0.5) -> Callable[[], None]:
        """Call ``on_lost`` (from a thread of its own) when the driver's end of this connection
        closes while the node runs: the driver died. Returns the function that stops watching.

        It polls for the peer's hang-up only (``POLLRDHUP``), never reads: a message the driver
        sends stays in the socket for whoever reads it.
        """
        done = threading.Event()
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLRDHUP)

        def watch() -> None:
            while not done.is_set():
                if poller.poll(every * 1000) and not done.is_set():
                    on_lost()
                    return

        threading.Thread(target=watch, daemon=True, name="torchdist-driver-watch").start()
        return done.set

    def close(self) -> None:
        self.send(Bye())
        with self._lock:
            try:
                self._sock.shutdown(socket.SHUT_WR)
                # Wait for the driver to finish reading, so nothing in flight is cut off.
                self._sock.settimeout(5)
                self._sock.recv(1)
            except OSError:
                pass
            self._sock.close()


def _unwrapped(reply: dict[str, Any], label: str, claim_secret: bytes | None, nonce: str) -> bytes:
    """A key from the driver's reply: wrapped under this node's claim secret where it proved one."""
    key = bytes.fromhex(str(reply[label]))
    return key if claim_secret is None else wrap_key(claim_secret, nonce, label, key)
