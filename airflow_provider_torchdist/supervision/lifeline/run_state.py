"""What the supervisor knows of its run: :class:`RunState`, which the supervisor feeds and the
lifeline serves, and each owner's subscription queue to it. Thread-safe, no sockets."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.supervision.lifeline.messages import (
    ENDED_STATES,
    ERROR_KINDS,
    FAILURE_MESSAGE_CHARS,
    FAILURE_TRACEBACK_CHARS,
    MAX_TEXT_CHARS,
    METRICS_BUDGET_BYTES,
    OWNER_QUEUE_LIMIT,
    REPLAY_LINES,
    WORLD_SIZE_REASON_CHARS,
    WORLD_SIZES_BUDGET_BYTES,
    MalformedMessage,
    encode,
)
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus, valid_world_size

# -- the supervisor's side ------------------------------------------------------------------------


class _Subscription:
    """One owner's queue: encoded events from :class:`RunState` (counted, dropped beyond ``limit``)
    and the session's own items (``CLOSE``, ``FETCH``, an error message as ``_Raw``)."""

    CLOSE = object()
    FETCH = object()

    def __init__(self, limit: int) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._dropped = 0
        self._limit = limit

    def offer(self, data: bytes) -> None:
        with self._lock:
            if self._pending >= self._limit:
                self._dropped += 1
                return
            self._pending += 1
        self.items.put(data)

    def took(self) -> int:
        """One offered event was taken; returns how many were dropped since the last one."""
        with self._lock:
            self._pending -= 1
            dropped, self._dropped = self._dropped, 0
            return dropped


@dataclass(frozen=True)
class _Raw:
    data: bytes


class RunState:
    """What the supervisor knows of its run; the lifeline serves it. Thread-safe, no sockets.

    The supervisor feeds it (``add_line``, ``set_application``, ``add_metric``, ``set_running``,
    ``finish``); every owner's stream is a subscription to it (``subscribe``). Its status carries
    the metric history so far and the time since it was made (``clock``: the supervisor's start),
    so that a status query shows a deferred run's progress with no owner in between.
    """

    def __init__(
        self,
        replay_lines: int = REPLAY_LINES,
        queue_limit: int = OWNER_QUEUE_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._started = clock()
        self._ended: float | None = None
        self._lock = threading.Lock()
        self._lines: deque[tuple[int, bytes]] = deque(maxlen=replay_lines)
        self._seq = 0
        self._state = "starting"
        self._app: tuple[str, str | None, str | None] | None = None
        self._error: str | None = None
        self._error_kind: str | None = None
        self._failures: list[dict[str, Any]] = []
        self._metrics: list[dict[str, Any]] = []
        self._world_sizes: list[dict[str, Any]] = []
        self._output: dict[str, Any] | None = None
        self._output_path: Path | None = None
        self._subscribers: list[_Subscription] = []
        self._queue_limit = queue_limit

    # -- fed by the supervisor

    def add_line(self, text: str) -> int:
        """Keep and send one log line; returns its sequence number."""
        if len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + " [torchdist: line cut]"
        with self._lock:
            self._seq += 1
            data = encode({"k": "line", "seq": self._seq, "text": text})
            self._lines.append((self._seq, data))
            self._publish(data)
            return self._seq

    def set_application(self, app_id: str, ui_url: str | None, operation: str | None = None) -> None:
        with self._lock:
            self._app = (app_id, ui_url, operation)
            self._publish(self._app_message())

    def add_metric(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._metrics.append(record)
            with contextlib.suppress(MalformedMessage, TypeError, ValueError):
                self._publish(encode({"k": "metric", "m": record}))

    def set_running(self) -> None:
        with self._lock:
            if self._state == "starting":
                self._state = "running"

    def finish(
        self,
        state: str,
        *,
        error: str | None = None,
        error_kind: str | None = None,
        failures: list[dict[str, Any]] | None = None,
        metrics: list[dict[str, Any]] | None = None,
        output: dict[str, Any] | None = None,
        output_path: Path | None = None,
        world_sizes: list[dict[str, Any]] | None = None,
    ) -> bool:
        """The run has ended: every owner gets ``done``. False (and nothing changes) if it had already.
        A failed run's ``error_kind`` is ``"run"`` unless told (``"training"``). ``world_sizes``
        (the driver's) keeps only well-formed entries, reasons cut to fit (:func:`_fitting_world_sizes`)."""
        if state not in ENDED_STATES:
            raise ValueError(f"a run ends as one of {ENDED_STATES}, not {state!r}")
        if error_kind not in ERROR_KINDS:
            raise ValueError(f"error_kind is one of {ERROR_KINDS}, not {error_kind!r}")
        with self._lock:
            if self._state in ENDED_STATES:
                return False
            self._state, self._error = state, error
            self._ended = self._clock()
            self._error_kind = (error_kind or "run") if state == "failed" else None
            self._failures = [_trimmed_failure(f) for f in failures or []]
            if metrics is not None:
                self._metrics = list(metrics)
            self._world_sizes = _fitting_world_sizes(world_sizes or [])
            self._output, self._output_path = output, output_path
            self._publish(self._done_message())
            return True

    # -- read by the lifeline

    @property
    def state(self) -> str:
        return self._state

    @property
    def ended(self) -> bool:
        return self._state in ENDED_STATES

    def status(self) -> RunStatus:
        with self._lock:
            return self._status()

    def output(self) -> tuple[dict[str, Any] | None, Path | None]:
        """Rank 0's output as the status describes it, and the file holding it."""
        with self._lock:
            return self._output, self._output_path

    def subscribe(self, since: int) -> tuple[RunStatus, _Subscription]:
        """The status now and a stream that starts with what an owner has not seen: kept lines
        after ``since``, the application, and ``done`` if the run has ended."""
        with self._lock:
            sub = _Subscription(self._queue_limit)
            if self._app is not None:
                sub.offer(self._app_message())
            for seq, data in self._lines:
                if seq > since:
                    sub.offer(data)
            if self._state in ENDED_STATES:
                sub.offer(self._done_message())
            self._subscribers.append(sub)
            return self._status(), sub

    def unsubscribe(self, sub: _Subscription) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._subscribers.remove(sub)

    # -- internals (under the lock)

    def _publish(self, data: bytes) -> None:
        for sub in self._subscribers:
            sub.offer(data)

    def _app_message(self) -> bytes:
        assert self._app is not None
        app_id, ui_url, operation = self._app
        message = {"k": "app", "app_id": app_id, "ui_url": ui_url}
        # Sent only when there is one: an owner of an earlier release knows no such key.
        return encode({**message, "operation": operation} if operation else message)

    def _status(self) -> RunStatus:
        app_id, ui_url, operation = self._app or (None, None, None)
        until = self._ended if self._ended is not None else self._clock()
        return RunStatus(
            state=self._state,
            app_id=app_id,
            ui_url=ui_url,
            operation=operation,
            error=self._error,
            error_kind=self._error_kind,
            failures=list(self._failures),
            metrics=newest_that_fit(self._metrics, METRICS_BUDGET_BYTES),
            output=self._output,
            last_seq=self._seq,
            elapsed_s=round(max(0.0, until - self._started), 3),
            world_sizes=list(self._world_sizes),
        )

    def _done_message(self) -> bytes:
        return encode({"k": "done", "status": self._status().to_dict()})


def _trimmed_failure(failure: dict[str, Any]) -> dict[str, Any]:
    """A failure that fits in a status: the tail of its traceback, the head of its message."""
    failure = dict(failure)
    if isinstance(failure.get("traceback"), str) and len(failure["traceback"]) > FAILURE_TRACEBACK_CHARS:
        failure["traceback"] = "...\n" + failure["traceback"][-FAILURE_TRACEBACK_CHARS:]
    if isinstance(failure.get("message"), str) and len(failure["message"]) > FAILURE_MESSAGE_CHARS:
        failure["message"] = failure["message"][:FAILURE_MESSAGE_CHARS] + " [cut]"
    return failure


def _fitting_world_sizes(entries: list[Any]) -> list[dict[str, Any]]:
    """What of the driver's ``world_sizes`` a status carries: each reason cut to
    ``WORLD_SIZE_REASON_CHARS``, then the well-formed entries only (an owner refuses a status
    holding any other), the newest that fit ``WORLD_SIZES_BUDGET_BYTES``."""
    cut = [
        {**e, "reason": e["reason"][:WORLD_SIZE_REASON_CHARS]}
        if isinstance(e, dict) and isinstance(e.get("reason"), str)
        else e
        for e in entries
    ]
    return newest_that_fit([e for e in cut if valid_world_size(e)], WORLD_SIZES_BUDGET_BYTES)


def newest_that_fit(
    records: list[dict[str, Any]], budget: int = METRICS_BUDGET_BYTES
) -> list[dict[str, Any]]:
    """The newest of ``records`` whose JSON fits in ``budget`` bytes, in order (what a status carries)."""
    kept: list[dict[str, Any]] = []
    for record in reversed(records):
        try:
            size = len(json.dumps(record, separators=(",", ":"))) + 1
        except (TypeError, ValueError):
            continue
        if size > budget:
            break
        budget -= size
        kept.append(record)
    kept.reverse()
    return kept
