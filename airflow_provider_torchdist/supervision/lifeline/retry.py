"""Trying again when a supervisor is busy: a connection flood may take every handshake slot for a
moment (the supervisor answers ``busy``), and a network may drop an attempt. Both raise
:class:`~airflow_provider_torchdist.supervision.lifeline.messages.LifelineUnreachable`, which is worth
another try as long as the caller can wait; :class:`RunGone` and a refused credential are not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from airflow_provider_torchdist.supervision.lifeline.messages import LifelineUnreachable

T = TypeVar("T")

#: How long an owner keeps trying a supervisor that is busy or does not answer: well within the
#: 15 s a supervisor waits for its first owner (a run that is not durable).
UNREACHABLE_RETRY_S = 10.0
#: The longest pause between two tries.
MAX_RETRY_PAUSE_S = 1.0


def retry_unreachable(call: Callable[[], T], timeout: float = UNREACHABLE_RETRY_S) -> T:
    """``call()``, tried again (0.05 s, then twice as long each time, at most 1 s apart) while it
    raises :class:`LifelineUnreachable`, for up to ``timeout`` seconds; then its last error.

    Example::

        owner = retry_unreachable(lambda: OwnerConnection(host, port, run_id, secret))
    """
    deadline, pause = time.monotonic() + timeout, 0.05
    while True:
        try:
            return call()
        except LifelineUnreachable:
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)  # not a wait for a condition: a pause before the next try
        pause = min(pause * 2, MAX_RETRY_PAUSE_S)


async def retry_unreachable_async(
    call: Callable[[], Awaitable[T]], timeout: float = UNREACHABLE_RETRY_S
) -> T:
    """:func:`retry_unreachable` for a coroutine (a trigger's connection): the pauses do not block
    the event loop."""
    deadline, pause = time.monotonic() + timeout, 0.05
    while True:
        try:
            return await call()
        except LifelineUnreachable:
            if time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, MAX_RETRY_PAUSE_S)
