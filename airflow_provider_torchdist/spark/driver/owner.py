"""The owner role: the Airflow side follows the run's log, application and metrics over the channel.

Instead of scraping ``spark-submit``'s stdout, the hook connects to the driver's run channel as its
**owner**:

1. Before ``spark-submit`` the hook writes a random owner token to ``<staging>/owner.token`` (0600)
   with :func:`write_owner_token`. It is not in the job spec, so no executor ever sees it.
2. The driver reads it (:func:`read_owner_token`) and, once its channel is bound, writes
   ``<staging>/channel.json`` = ``{"host", "port"}`` (:func:`write_channel_address`, atomic, 0600).
3. The hook connects with :class:`OwnerClient` and reads typed events until the run ends::

       with OwnerClient(read_channel_address(staging), token) as owner:
           for event in owner.events():
               if isinstance(event, LogLine): log.info(event.text)
               elif isinstance(event, Application): push_link(event.app_id, event.ui_url)
               elif isinstance(event, Metric): metrics.append(event.record)

An owner first gets the application event (once known), then the last ``REPLAY_LINES`` log lines
and every metric record so far, in the order they happened, then the live stream; ``events()`` ends when the driver closes the channel. The driver's side of
the stream is :class:`OwnerHub`. Standard library only: the hook imports this module too.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from airflow_provider_torchdist.spark.wire.channel_auth import (
    HELLO_TIMEOUT_S,
    PROTOCOL_VERSION,
    ChannelRefused,
    HelloRefused,
    read_json,
    send_json,
)
from airflow_provider_torchdist.spark.wire.jobspec import CHANNEL_FILE, OWNER_TOKEN_FILE
from airflow_provider_torchdist.spark.wire.private_files import write_private_text
from airflow_provider_torchdist.spark.wire.protocol import (
    Application,
    LogLine,
    Metric,
    OwnerEvent,
    ProtocolError,
    decode,
    encode,
)

#: How many of the latest log lines an owner that connects late gets first.
REPLAY_LINES = 1000
#: Events queued for one owner that reads too slowly; beyond it the driver drops events for it
#: (and says so in its stream) rather than hold up the ranks' logs.
OWNER_QUEUE_LIMIT = 100_000
#: How long the driver waits for a stalled owner to take a message before it drops that owner.
OWNER_SEND_TIMEOUT_S = 30.0


def write_owner_token(staging_dir: str | Path) -> str:
    """The hook's side: make a fresh owner token and write it for the driver (0600); returns it."""
    token = secrets.token_urlsafe(32)
    write_private_text(Path(staging_dir) / OWNER_TOKEN_FILE, token)
    return token


def read_owner_token(staging_dir: str | Path) -> str | None:
    """The driver's side: the owner token the hook wrote, None when there is none."""
    try:
        token = (Path(staging_dir) / OWNER_TOKEN_FILE).read_text().strip()
    except OSError:
        return None
    return token or None


def write_channel_address(staging_dir: str | Path, address: tuple[str, int]) -> Path:
    """The driver's side: where its channel listens, as ``channel.json`` (atomic, 0600)."""
    return write_private_text(
        Path(staging_dir) / CHANNEL_FILE, json.dumps({"host": address[0], "port": address[1]})
    )


def read_channel_address(staging_dir: str | Path) -> tuple[str, int] | None:
    """The hook's side: the driver's channel address, None until the driver has written it."""
    try:
        data = json.loads((Path(staging_dir) / CHANNEL_FILE).read_text())
        return str(data["host"]), int(data["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class OwnerClient:
    """The Airflow side's connection to the driver as the run's owner (see the module docstring).

    Raises :class:`~airflow_provider_torchdist.spark.wire.channel_auth.ChannelRefused` (a
    ``ConnectionError``) when the driver does not accept the owner token.
    """

    def __init__(
        self, address: tuple[str, int], owner_token: str, *, timeout: float = HELLO_TIMEOUT_S
    ) -> None:
        self._sock = socket.create_connection(tuple(address), timeout=timeout)
        try:
            send_json(self._sock, {"v": PROTOCOL_VERSION, "role": "owner", "owner_token": owner_token})
            reply = read_json(self._sock, time.monotonic() + timeout)
            if reply.get("ok") is not True:
                raise ChannelRefused(f"the driver refused the owner connection: {reply.get('error', reply)}")
        except (HelloRefused, OSError) as exc:
            self._sock.close()
            if isinstance(exc, ChannelRefused):
                raise
            raise ChannelRefused(f"the driver did not accept the owner connection: {exc}") from None
        self._sock.settimeout(None)
        self._reader = self._sock.makefile("rb")

    def events(self) -> Iterator[OwnerEvent]:
        """The run's events as they happen; ends when the driver closes the channel (or on close())."""
        while True:
            try:
                raw = self._reader.readline()
            except (OSError, ValueError):  # closed under us, by close() or the network
                return
            if not raw:
                return  # the driver closed the channel: the run is over
            event = decode(raw)
            if not isinstance(event, (LogLine, Application, Metric)):
                raise ProtocolError(f"an owner does not expect {event.KIND!r} messages")
            yield event

    def close(self) -> None:
        """Stop reading; an ``events()`` loop in another thread ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> OwnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Subscriber:
    """One owner connection's queue of events, sent by its own thread."""

    def __init__(self, replay: list[OwnerEvent]) -> None:
        self.events: queue.SimpleQueue[OwnerEvent | None] = queue.SimpleQueue()
        for event in replay:
            self.events.put(event)
        self.queued = len(replay)
        self.dropped = 0
        self.done = threading.Event()


class OwnerHub:
    """The driver's side of the owner stream: keeps the replay, fans events out to every owner.

    ``publish`` never blocks on an owner: each owner has its own queue, emptied by the thread that
    serves its connection (:meth:`serve`).
    """

    def __init__(self, replay_lines: int = REPLAY_LINES, queue_limit: int = OWNER_QUEUE_LIMIT) -> None:
        self._lock = threading.Lock()
        # Lines and metrics are numbered as published, so a late owner's replay keeps their order.
        self._seq = 0
        self._lines: deque[tuple[int, LogLine]] = deque(maxlen=replay_lines)
        # Every metric, not only the latest: an owner that connects after the ranks' first reports
        # (a supervisor's follower slowed by a loaded machine) would otherwise never see them, and
        # the Training view would miss those points for the whole run. The channel's ledger keeps
        # them all too, so this bounds nothing new.
        self._metrics: list[tuple[int, Metric]] = []
        self._application: Application | None = None
        self._subscribers: list[_Subscriber] = []
        self._queue_limit = queue_limit
        self._closed = False

    def publish(self, event: OwnerEvent) -> None:
        with self._lock:
            if self._closed:
                return
            self._seq += 1
            if isinstance(event, LogLine):
                self._lines.append((self._seq, event))
            elif isinstance(event, Metric):
                self._metrics.append((self._seq, event))
            elif isinstance(event, Application):
                self._application = event
            for sub in self._subscribers:
                if sub.queued >= self._queue_limit:
                    sub.dropped += 1
                else:
                    sub.queued += 1
                    sub.events.put(event)

    def serve(self, conn: socket.socket) -> None:
        """Send this owner the replay, then the live events, until the hub closes or the owner goes."""
        with self._lock:
            replay: list[OwnerEvent] = [self._application] if self._application else []
            replay += [event for _, event in heapq.merge(self._lines, self._metrics, key=lambda x: x[0])]
            sub = _Subscriber(replay)
            if self._closed:
                # The channel closed between this owner's hello and now: it was told "ok", so it
                # still gets the replay (the whole run, as far as kept), then the end.
                sub.events.put(None)
            else:
                self._subscribers.append(sub)
        conn.settimeout(OWNER_SEND_TIMEOUT_S)
        try:
            while (event := sub.events.get()) is not None:
                with self._lock:
                    sub.queued -= 1
                    dropped, sub.dropped = sub.dropped, 0
                if dropped:
                    notice = f"[torchdist] {dropped} event(s) were not sent to this reader: it fell behind"
                    conn.sendall(encode(LogLine(notice)))
                conn.sendall(encode(event))
            conn.shutdown(socket.SHUT_WR)  # the end of the run: the owner's events() ends
        except OSError:
            pass  # the owner went away (or stalled past the timeout): it is simply no longer served
        finally:
            with self._lock:
                if sub in self._subscribers:
                    self._subscribers.remove(sub)
            sub.done.set()

    def close(self, timeout: float = 5.0) -> None:
        """End every owner's stream once its queued events are sent (waits up to ``timeout``)."""
        with self._lock:
            self._closed = True
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub.events.put(None)
        deadline = time.monotonic() + timeout
        for sub in subscribers:
            sub.done.wait(max(0.0, deadline - time.monotonic()))
