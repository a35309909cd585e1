"""The run channel: how ranks and agents on any host talk back to the driver.

One TCP server per run, on the driver. Every connection opens with a hello that carries the run's
secret token; a connection without it is dropped before anything it sends is read. After the hello
each message is one JSON line; an ``output`` message is followed by its raw bytes.

Messages:

- ``{"k": "line", "s": "out"|"err", "l": text}``: one line a rank printed, forwarded to the task log;
- ``{"k": "error", ...}``: the exception a rank raised (type, message, traceback);
- ``{"k": "node", "node": n}``: a barrier task started (so the stage is no longer waiting for slots);
- ``{"k": "master", "host": h, "port": p}``: barrier task 0's rendezvous endpoint;
- ``{"k": "master?", "timeout": s}``: another barrier task asks for it; the driver answers with one
  line, ``{"host": h, "port": p}`` or ``{"error": why}``, as soon as it knows (Spark's own
  ``allGather`` polls once a second, this costs a round trip). A stage attempt runs every node
  once, so the n-th ``node`` message of a node belongs to the n-th attempt (generation): a retried
  stage never gets the endpoint of an attempt before it;
- ``{"k": "failures", "failures": [...]}``: an agent's verdict that its node failed;
- ``{"k": "metric", "m": {...}}``: a ``report()`` from training code, logged and kept in order;
- ``{"k": "output", "n": size, "sha256": hex}`` + ``size`` bytes: rank 0's pickled return value
  (the driver records the digest beside the file, for the Airflow side to sign);
- ``{"k": "bye"}``: a clean close. A connection that ends without it is reported in the log.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.jobspec import OUTPUT_DIGEST_SUFFIX, OUTPUT_FILE
from airflow_provider_torchdist.spark.metrics import format_metrics
from airflow_provider_torchdist.spark.outcome import RankFailure

HELLO_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


def publish_output(part: Path, output_dir: Path, sha256: str | None) -> Path:
    """Make the complete pickle at ``part`` rank 0's output in ``output_dir``, atomically, and record
    its digest beside it (named by size, inode and mtime, so it can never vouch for another file).

    A restarted worker group may send again: the latest complete output wins.
    """
    final = output_dir / OUTPUT_FILE
    os.replace(part, final)
    if isinstance(sha256, str):
        st = final.stat()
        record = {"sha256": sha256, "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
        digest_file = final.with_name(OUTPUT_FILE + OUTPUT_DIGEST_SUFFIX)
        digest_part = digest_file.with_name(f".{digest_file.name}.part")
        digest_part.write_text(json.dumps(record))
        os.replace(digest_part, digest_file)
    return final


def rank_prefix(rank: int | None, host: str | None) -> str:
    """The prefix every forwarded line carries in the task log: ``[rank 1 @ 10.0.0.2]``."""
    who = "agent" if rank is None else f"rank {rank}"
    return f"[{who} @ {host}]" if host else f"[{who}]"


class RunChannel:
    """The driver's end: accepts this run's ranks, prints their lines, keeps errors and the output.

    Example::

        with RunChannel(token, "127.0.0.1", staging_dir) as channel:
            ...  # ranks connect to channel.address
        channel.failures  # what ranks and agents reported
    """

    def __init__(
        self,
        token: str,
        bind_host: str,
        output_dir: str | Path,
        on_failure: Callable[[], None] | None = None,
        out: Any = None,
    ) -> None:
        self._token = token.encode()
        self._output_dir = Path(output_dir)
        self._on_failure = on_failure
        self._out = out or sys.stdout
        self._print_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.rank_errors: dict[int, RankFailure] = {}
        self.agent_failures: list[RankFailure] = []
        self.metrics: list[dict[str, Any]] = []
        self.started_nodes: set[int] = set()
        #: The host each started barrier task (node) runs on, as it said in its hello.
        self.node_hosts: dict[int, str | None] = {}
        #: Ranks whose connection ended without a goodbye: (host, when). A rank killed by a signal
        #: cannot say so itself; this is how the driver still knows it died, and died first.
        self.vanished: dict[int, tuple[str | None, float]] = {}
        self._first_problem: dict[int, float] = {}
        self.rejected = 0
        #: Task 0's rendezvous endpoint per generation (stage attempt); waiters are woken when one arrives.
        self._masters: dict[int, tuple[str, int]] = {}
        self._node_starts: dict[int, int] = {}
        self._masters_changed = threading.Condition(self._state_lock)
        self._closed = False
        channel = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                channel._serve(self.connection, self.rfile)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = _Server((bind_host, 0), _Handler)
        # serve_forever polls for shutdown; its 0.5 s default would be a 0.25 s wait on average at
        # close, at the end of every run.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), name="torchdist-channel", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def __enter__(self) -> RunChannel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._masters_changed:
            self._closed = True
            self._masters_changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def wait_for_master(self, generation: int, timeout: float) -> dict[str, Any]:
        """Task 0's endpoint for this generation (stage attempt), once reported: ``{"host", "port"}``.

        ``{"error": why}`` instead when a node failed first, the channel closed, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        with self._masters_changed:
            while generation not in self._masters:
                left = deadline - time.monotonic()
                if self.agent_failures or self._closed or left <= 0:
                    why = (
                        "another barrier task failed before the rendezvous"
                        if self.agent_failures
                        else "the driver is shutting down"
                        if self._closed
                        else f"barrier task 0 did not report its rendezvous endpoint within {timeout:.0f}s"
                    )
                    return {"error": why}
                self._masters_changed.wait(left)
            host, port = self._masters[generation]
        return {"host": host, "port": port}

    @property
    def failures(self) -> list[RankFailure]:
        """The failures that ended the run: each agent's record filled in with the rank's own.

        Only an agent decides that a rank failed for good: with ``max_restarts`` a rank that raised
        may have been restarted and succeeded, so a rank's own error alone is not a failure.
        """
        with self._state_lock:
            if not self.agent_failures:
                return []
            merged: dict[int | None, RankFailure] = {}
            for i, failure in enumerate(self.agent_failures):
                own = self.rank_errors.get(failure.rank) if failure.rank is not None else None
                merged[failure.rank if failure.rank is not None else -1 - i] = (
                    own.merge(failure) if own else failure
                )
            # A rank that vanished without reporting, while the agent blamed a peer that lost it.
            for rank, (host, _) in self.vanished.items():
                if rank not in merged and rank not in self.rank_errors:
                    merged[rank] = RankFailure(
                        rank=rank,
                        host=host,
                        message="the process died without reporting an error (killed by a signal, "
                        "e.g. SIGKILL from the OOM killer, or ended by os._exit)",
                    )
            first = {**{r: t for r, (_, t) in self.vanished.items()}, **self._first_problem}
            # Root cause first: the rank whose trouble started earliest.
            return sorted(
                merged.values(), key=lambda f: (first.get(f.rank, float("inf")), f.rank is None, f.rank or 0)
            )

    def say(self, text: str) -> None:
        """Print a line of the driver's own to the task log."""
        self._print(f"[torchdist] {text}")

    def _print(self, line: str) -> None:
        with self._print_lock:
            self._out.write(line + "\n")
            self._out.flush()

    def _serve(self, conn: socket.socket, rfile: BinaryIO) -> None:
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = json.loads(rfile.readline(65536) or b"{}")
        except (OSError, ValueError):
            hello = {}
        if not isinstance(hello, dict) or not hmac.compare_digest(
            str(hello.get("token", "")).encode(), self._token
        ):
            # Not one of this run's ranks: drop it without reading anything it sends.
            with self._state_lock:
                self.rejected += 1
            return
        conn.settimeout(None)
        rank, host = hello.get("rank"), hello.get("host")
        prefix = rank_prefix(rank, host)
        clean = False
        generation = 0
        try:
            for raw in rfile:
                msg = json.loads(raw)
                kind = msg.get("k")
                if kind == "line":
                    self._print(f"{prefix} {msg['l']}")
                elif kind == "error":
                    with self._state_lock:
                        self.rank_errors[rank] = RankFailure(rank=rank, host=host, **msg["e"])
                        self._first_problem.setdefault(rank, time.monotonic())
                elif kind == "failures":
                    with self._masters_changed:
                        self.agent_failures.extend(RankFailure(**f) for f in msg["failures"])
                        self._masters_changed.notify_all()
                    if self._on_failure:
                        self._on_failure()
                elif kind == "node":
                    with self._state_lock:
                        generation = self._node_starts.get(int(msg["node"]), 0)
                        self._node_starts[int(msg["node"])] = generation + 1
                        self.started_nodes.add(int(msg["node"]))
                        self.node_hosts[int(msg["node"])] = host
                elif kind == "master":
                    with self._masters_changed:
                        self._masters[generation] = (str(msg["host"]), int(msg["port"]))
                        self._masters_changed.notify_all()
                elif kind == "master?":
                    answer = self.wait_for_master(generation, float(msg.get("timeout", 300)))
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                elif kind == "metric":
                    with self._state_lock:
                        self.metrics.append(msg["m"])
                    self._print(f"[metrics] {format_metrics(msg['m'])}")
                elif kind == "output":
                    self._receive_output(rank, int(msg["n"]), rfile, msg.get("sha256"))
                elif kind == "bye":
                    clean = True
                    break
        except (OSError, ValueError) as exc:
            self.say(f"channel from {prefix} broke: {exc!r}")
        if not clean:
            if rank is not None:
                with self._state_lock:
                    self.vanished.setdefault(rank, (host, time.monotonic()))
            self.say(
                f"channel from {prefix} closed without a goodbye: the process may have died; "
                "anything it printed after this is only in its executor's log"
            )

    def _receive_output(
        self, rank: int | None, size: int, rfile: BinaryIO, sha256: str | None = None
    ) -> None:
        if rank != 0:
            raise ValueError(f"rank {rank} sent an output; only global rank 0 may")
        final = self._output_dir / OUTPUT_FILE
        part = final.with_name(f".{OUTPUT_FILE}.part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            left = size
            while left:
                chunk = rfile.read(min(left, _CHUNK))
                if not chunk:
                    raise ValueError(f"rank 0's output ended after {size - left} of {size} bytes")
                f.write(chunk)
                left -= len(chunk)
        publish_output(part, self._output_dir, sha256)


class ChannelClient:
    """A rank's or agent's end of the run channel. Thread-safe; never raises after connecting.

    When the connection breaks, ``broken`` holds why and sends become no-ops, so callers can fall
    back to local output and say so.
    """

    def __init__(self, address: tuple[str, int], token: str, rank: int | None, host: str | None) -> None:
        self._lock = threading.Lock()
        self.broken: str | None = None
        self._sock = socket.create_connection(tuple(address), timeout=HELLO_TIMEOUT_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_raw(json.dumps({"token": token, "rank": rank, "host": host}).encode() + b"\n")

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

    def send(self, msg: dict[str, Any]) -> bool:
        return self._send_raw(json.dumps(msg).encode() + b"\n")

    def line(self, stream: str, text: str) -> bool:
        return self.send({"k": "line", "s": stream, "l": text})

    def error(self, failure: dict[str, Any]) -> bool:
        return self.send({"k": "error", "e": failure})

    def failures(self, failures: list[RankFailure]) -> bool:
        from dataclasses import asdict

        return self.send({"k": "failures", "failures": [asdict(f) for f in failures]})

    def announce_master(self, host: str, port: int) -> bool:
        """Barrier task 0 (after its ``node`` message): the rendezvous endpoint for the other tasks."""
        return self.send({"k": "master", "host": host, "port": port})

    def wait_for_master(self, timeout: float) -> tuple[str, int]:
        """Another barrier task (after its ``node`` message): ask the driver for task 0's endpoint.

        Waits until the driver has it. Raises ``RuntimeError`` when the driver cannot tell (a node
        failed first, the wait timed out).
        """
        if not self.send({"k": "master?", "timeout": timeout}):
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
            answer = json.loads(reply)
        except ValueError:
            raise RuntimeError(
                "the driver closed the run channel before it sent the rendezvous endpoint"
            ) from None
        if "error" in answer:
            raise RuntimeError(f"no rendezvous endpoint: {answer['error']}")
        return str(answer["host"]), int(answer["port"])

    def output(self, data: bytes) -> bool:
        header = json.dumps({"k": "output", "n": len(data)}).encode() + b"\n"
        return self._send_raw(header, memoryview(data))

    def output_file(self, path: str, sha256: str | None = None) -> bool:
        """Stream a pickled output from a file: the bytes never sit in this process's memory."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            msg: dict[str, Any] = {"k": "output", "n": size}
            if sha256:
                msg["sha256"] = sha256
            header = json.dumps(msg).encode() + b"\n"
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

    def close(self) -> None:
        self.send({"k": "bye"})
        with self._lock:
            try:
                self._sock.shutdown(socket.SHUT_WR)
                # Wait for the driver to finish reading, so nothing in flight is cut off.
                self._sock.settimeout(5)
                self._sock.recv(1)
            except OSError:
                pass
            self._sock.close()
