"""The owner's sync client: :class:`OwnerConnection` (follow a run, command it, fetch its output)
and :func:`query_status` (a run's status, without owning it)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_torchdist.supervision.lifeline.address import open_lifeline
from airflow_provider_torchdist.supervision.lifeline.events import Event, _Events
from airflow_provider_torchdist.supervision.lifeline.handshake import _ClientHandshake
from airflow_provider_torchdist.supervision.lifeline.messages import (
    HELLO_TIMEOUT_S,
    MAX_WHY_CHARS,
    OWNER_KINDS,
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    LifelineError,
    read_message,
)
from airflow_provider_torchdist.supervision.lifeline.output import receive_output
from airflow_provider_torchdist.supervision.lifeline.sealed import StreamTampered
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus

# -- the sync client ------------------------------------------------------------------------------


def _connect(
    handshake: _ClientHandshake, host: str, port: int, timeout: float
) -> tuple[socket.socket, BinaryIO, RunStatus]:
    deadline = time.monotonic() + timeout
    try:
        sock = open_lifeline(host, port, timeout)  # TCP, or a unix socket in a private directory
    except OSError as exc:
        raise handshake.not_connected(exc) from None
    reader = sock.makefile("rb")
    try:

        def receive() -> dict[str, Any] | None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            return read_message(reader)

        sock.sendall(handshake.hello())
        sock.sendall(handshake.answer(receive()))  # a reset: retried (failed() below), not gone
        status = handshake.welcome(receive())
    except BaseException as exc:
        reader.close()
        sock.close()
        failure = handshake.failed(exc, timeout)
        if failure is exc:
            raise
        raise failure from None
    return sock, reader, status


class OwnerConnection:
    """A lifeline to a run's supervisor, as its owner (see :mod:`airflow_provider_torchdist.supervision.lifeline`).

    Connects and authenticates both ways in the constructor: :class:`RunGone` when nothing listens
    there, :class:`LifelineUnreachable` when the address does not answer, :class:`LifelineError`
    when the other end is not this run's supervisor or refuses the credential. ``status`` is the
    run's status at that moment. While open, a thread pings every ``PING_INTERVAL_S``.

    Every message after the handshake is sealed both ways (:mod:`.sealed`): one that fails its MAC
    closes the lifeline with :class:`~.sealed.StreamTampered`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        run_id: str,
        secret: bytes,
        *,
        kind: str = "task",
        since: int = 0,
        timeout: float = HELLO_TIMEOUT_S,
        ping_interval: float = PING_INTERVAL_S,
        silence: float = OWNER_SILENCE_S,
    ) -> None:
        handshake = _ClientHandshake(host, port, run_id, secret, kind, since)
        self.run_id, self.kind, self.where = run_id, kind, handshake.where
        self._sock, self._reader, self.status = _connect(handshake, host, port, timeout)
        self._sealer, self._opener = handshake.stream()
        self._sock.settimeout(silence)
        self._silence = silence
        self._events = _Events(run_id, handshake.where)
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None
        if kind in OWNER_KINDS:
            self._pinger = threading.Thread(
                target=self._ping, args=(ping_interval,), name="torchdist-lifeline-ping", daemon=True
            )
            self._pinger.start()

    def events(self) -> Iterator[Event]:
        """The run's events, up to and including :class:`DoneEvent`.

        Raises :class:`LifelineError` when the lifeline closes or goes silent before ``done`` (the
        supervisor's reason included when it gave one): the run may still be training, and a new
        connection with ``since=<last seq>`` picks the stream up again.
        """
        while self._events.done is None:
            try:
                msg = self._read()
            except TimeoutError:
                raise self._events.silent(self._silence) from None
            except (OSError, ValueError) as exc:  # ValueError: read after close()
                if self._closed.is_set():
                    msg = None
                else:
                    raise LifelineError(
                        f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                    ) from None
            if msg is None and self._closed.is_set():
                raise LifelineError(f"the lifeline to run {self.run_id} was closed by its owner")
            event = self._events.take(msg)
            if event is not None:
                yield event

    def _read(self) -> dict[str, Any] | None:
        """The next sealed message (None at the end of the stream); a tampered stream is closed."""
        try:
            return self._opener.read(self._reader)
        except StreamTampered:
            self.close()
            raise

    @property
    def done(self) -> RunStatus | None:
        """The final status once :meth:`events` yielded it."""
        return self._events.done

    def stop(self, why: str | None = None) -> None:
        """End the run: its supervisor gives the ranks ``stop_grace_period`` to checkpoint, then tears
        it down (its state becomes failed, "stopped by its owner (why)"). ``why``: "timeout", ..."""
        self._command("stop", why)

    def detach(self) -> None:
        """Leave on purpose: the run waits ``reattach_timeout`` for its next owner."""
        self._command("detach")

    def release(self) -> None:
        """The result is taken (or not wanted): the supervisor tears the ended run down."""
        self._command("release")

    def wait_closed(self, timeout: float) -> bool:
        """After :meth:`release`: wait until the supervisor closes the lifeline, which it does once
        the run is torn down (spark-submit ended, the staging directory gone); False when
        ``timeout`` seconds pass first. For an owner whose end also ends the supervisor (a task
        in a pod of its own)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._read() is None:
                    return True
            except TimeoutError:
                return False  # silent for longer than its pings allow (and the reader is spent)
            except StreamTampered:
                return False  # what came is not the supervisor's: nothing is known of its teardown
            except (OSError, ValueError):
                return True
        return False

    def fetch_output(self, dest_dir: Path) -> Path | None:
        """Rank 0's output, once the run has ended, as ``dest_dir/output.pkl`` (0600) with the
        manifest beside it that :class:`~airflow_provider_torchdist.spark.wire.output_store.OutputManifest`
        reads; None when the run has none (a script, a failed run).

        Reads the rest of the event stream first when :meth:`events` has not reached ``done``.
        The bytes are checked against the size and SHA-256 of the status; :class:`LifelineError`
        when they differ (nothing is left in ``dest_dir`` then).
        """
        for _ in self.events():
            pass
        # The status of a sealed "done" (events() takes no other): the manifest the bytes must match
        # is one the supervisor sent under this session's MAC, never one a network put in.
        status = self._events.done
        assert status is not None
        if status.output is None:
            return None
        expected = status.output
        self._send({"k": "fetch"})
        try:
            return receive_output(
                self._reader, self._opener, self._events, self._silence, expected, Path(dest_dir)
            )
        except StreamTampered:
            self.close()
            raise

    def _command(self, name: str, why: str | None = None) -> None:
        try:
            self._send({"k": name, **({"why": why[:MAX_WHY_CHARS]} if why else {})})
        except LifelineError:
            # After "done" the run is over either way: a lifeline the supervisor already closed
            # (it tore the run down) is not worth an error.
            if self._events.done is None:
                raise

    def _send(self, msg: dict[str, Any]) -> None:
        with self._write_lock:  # sealed under the lock: the numbers go out in the order they are given
            if self._closed.is_set():
                raise LifelineError(f"the lifeline to run {self.run_id} is closed")
            data = self._sealer.seal_message(msg)
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None

    def _ping(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self._send({"k": "ping"})
            except LifelineError:
                return

    def close(self) -> None:
        """Close the lifeline (an ``events()`` loop in another thread ends with :class:`LifelineError`).

        Closing without ``detach`` or ``release`` counts as a lost owner."""
        with self._write_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._reader.close()
        self._sock.close()

    def __enter__(self) -> OwnerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_status(
    host: str, port: int, run_id: str, secret: bytes, timeout: float = HELLO_TIMEOUT_S
) -> RunStatus:
    """The run's status, without becoming its owner (:class:`RunGone` when no supervisor is there)."""
    handshake = _ClientHandshake(host, port, run_id, secret, "status", 0)
    sock, reader, status = _connect(handshake, host, port, timeout)
    reader.close()
    sock.close()
    return status
