"""The owner's async client: :class:`AsyncOwnerConnection`, the sync client's counterpart on
asyncio streams (what a trigger follows a run with)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow_provider_torchdist.supervision.lifeline.address import open_lifeline_async
from airflow_provider_torchdist.supervision.lifeline.events import Event, _Events
from airflow_provider_torchdist.supervision.lifeline.handshake import _ClientHandshake
from airflow_provider_torchdist.supervision.lifeline.messages import (
    HELLO_TIMEOUT_S,
    MAX_LINE_BYTES,
    MAX_WHY_CHARS,
    OWNER_KINDS,
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    LifelineError,
    MalformedMessage,
    decode,
)
from airflow_provider_torchdist.supervision.lifeline.sealed import (
    MAX_SEALED_LINE_BYTES,
    Opener,
    Sealer,
    StreamTampered,
)
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus

# -- the async client -----------------------------------------------------------------------------


class AsyncOwnerConnection:
    """:class:`OwnerConnection` on asyncio streams, for a trigger.

    Example::

        conn = await AsyncOwnerConnection.connect(host, port, run_id, secret, kind="trigger", since=n)
        async for event in conn.events():
            ...
        await conn.detach()
        await conn.close()
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        run_id: str,
        kind: str,
        where: str,
        status: RunStatus,
        silence: float,
        ping_interval: float,
        stream: tuple[Sealer, Opener],
    ) -> None:
        """Use :meth:`connect` (this takes a connection already authenticated, and the sealer and
        opener of its session)."""
        self._reader, self._writer = reader, writer
        self._sealer, self._opener = stream
        self.run_id, self.kind, self.where, self.status = run_id, kind, where, status
        self._silence = silence
        self._events = _Events(run_id, where)
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._pinger: asyncio.Task[None] | None = None
        if kind in OWNER_KINDS:
            self._pinger = asyncio.get_running_loop().create_task(self._ping(ping_interval))

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        run_id: str,
        secret: bytes,
        *,
        kind: str = "trigger",
        since: int = 0,
        timeout: float = HELLO_TIMEOUT_S,
        ping_interval: float = PING_INTERVAL_S,
        silence: float = OWNER_SILENCE_S,
    ) -> AsyncOwnerConnection:
        """Connect and authenticate both ways; raises as :class:`OwnerConnection` does."""
        handshake = _ClientHandshake(host, port, run_id, secret, kind, since)
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's can swallow a cancellation
                reader, writer = await open_lifeline_async(host, port, limit=MAX_SEALED_LINE_BYTES + 1)
        except OSError as exc:  # TimeoutError included
            raise handshake.not_connected(exc) from None

        async def receive() -> dict[str, Any] | None:
            return await _read_async(reader, max(0.0, deadline - time.monotonic()))

        try:
            writer.write(handshake.hello())
            await writer.drain()
            writer.write(handshake.answer(await receive()))  # a reset: retried (failed()), not gone
            await writer.drain()
            status = handshake.welcome(await receive())
        except BaseException as exc:
            writer.close()
            failure = handshake.failed(exc, timeout)
            if failure is exc:
                raise
            raise failure from None
        stream = handshake.stream()
        return cls(reader, writer, run_id, kind, handshake.where, status, silence, ping_interval, stream)

    async def events(self) -> AsyncIterator[Event]:
        """As :meth:`OwnerConnection.events`."""
        while self._events.done is None:
            try:
                msg = await _read_async(self._reader, self._silence, self._opener)
            except TimeoutError:
                raise self._events.silent(self._silence) from None
            except StreamTampered:
                await self.close()
                raise
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None
            event = self._events.take(msg)
            if event is not None:
                yield event

    async def stop(self, why: str | None = None) -> None:
        """As :meth:`OwnerConnection.stop`."""
        await self._command("stop", why)

    async def detach(self) -> None:
        await self._command("detach")

    async def release(self) -> None:
        await self._command("release")

    async def _command(self, name: str, why: str | None = None) -> None:
        try:
            await self._send({"k": name, **({"why": why[:MAX_WHY_CHARS]} if why else {})})
        except LifelineError:
            if self._events.done is None:
                raise

    async def _send(self, msg: dict[str, Any]) -> None:
        async with self._write_lock:  # sealed under the lock: the numbers go out in order
            if self._closed:
                raise LifelineError(f"the lifeline to run {self.run_id} is closed")
            data = self._sealer.seal_message(msg)
            try:
                self._writer.write(data)
                await self._writer.drain()
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None

    async def _ping(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self._send({"k": "ping"})
            except LifelineError:
                return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pinger
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            async with asyncio.timeout(2.0):
                await self._writer.wait_closed()

    async def __aenter__(self) -> AsyncOwnerConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _read_async(
    reader: asyncio.StreamReader, timeout: float, opener: Opener | None = None
) -> dict[str, Any] | None:
    """The next message (sealed, with ``opener``: after the handshake); None at the end."""
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when it completes
        # as the task is cancelled, swallowing the cancellation (a triggerer's cancel then hangs).
        async with asyncio.timeout(timeout):
            raw = await reader.readline()
    except ValueError:  # asyncio's own "over the limit" (LimitOverrunError)
        raise MalformedMessage(f"a message of more than {MAX_LINE_BYTES} bytes was refused") from None
    if not raw.endswith(b"\n"):
        return None
    return decode(raw) if opener is None else opener.open(raw)
