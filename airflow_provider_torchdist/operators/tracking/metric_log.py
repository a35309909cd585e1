"""Metrics to MLflow off the follow loop: a bounded buffer and one background thread.

The follow loop only appends to the buffer (:meth:`MetricLog.offer`, never a network call), so a
slow or unreachable tracking server cannot slow the run's log, XCom or training. The thread sends
what is buffered in batches, at most one request every ``interval`` seconds (a full batch goes at
once): a run that reports every few milliseconds costs the server, and the machine it shares with
the ranks, one request a second, not one a report. When a send fails it keeps the batch, says once in the task log that
the server is unreachable, and tries again with a backoff until the server is back. The buffer
holds at most ``capacity`` values: past that the oldest are dropped and counted. :meth:`close`
flushes for up to ``flush_timeout`` seconds and says in the task log what could not be logged.

Each ``report()`` record becomes one value per metric at its ``step``, timestamped with its
``time``; rank 0's under the metric's name, another rank's (``all_ranks=True``) as ``name/rank<r>``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_torchdist.spark.node.metrics import RECORD_FIELDS

#: Values buffered at most while the server is unreachable (about 10 MB).
DEFAULT_CAPACITY = 100_000
#: MLflow's limit on metrics per ``log_batch`` call.
BATCH_SIZE = 1000
#: The backoff between tries while the server is unreachable: from the first to the last, doubling.
RETRY_BACKOFF_S = (0.5, 10.0)
#: The shortest time between two sends, while the buffer holds less than a batch.
SEND_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricValue:
    """One value to log: MLflow's ``Metric`` fields."""

    key: str
    value: float
    timestamp: int
    step: int


def metric_values(record: dict[str, Any]) -> list[MetricValue]:
    """The values of one ``report()`` record (non-numbers skipped; NaN and infinities are MLflow's to take)."""
    rank = record.get("rank", 0)
    suffix = "" if rank in (0, None) else f"/rank{rank}"
    timestamp = int(float(record.get("time") or time.time()) * 1000)
    step = int(record.get("step") or 0)
    values = []
    for key, value in record.items():
        if key in RECORD_FIELDS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values.append(MetricValue(f"{key}{suffix}", float(value), timestamp, step))
    return values


class MetricLog:
    """Log metric values to one MLflow run from a background thread (see the module docstring).

    ``send`` logs one batch (it raises when the server is unreachable); ``on_outage`` is told of
    each outage's start and end. Thread-safe.

    Example::

        metrics = MetricLog(lambda batch: client.log_batch(run_id, metrics=[...]))
        metrics.offer(record)  # from the follow loop, for each report()
        metrics.close()        # flushes, and logs what could not be sent
    """

    def __init__(
        self,
        send: Callable[[Sequence[MetricValue]], None],
        *,
        capacity: int = DEFAULT_CAPACITY,
        flush_timeout: float = 30.0,
        backoff: tuple[float, float] = RETRY_BACKOFF_S,
        interval: float = SEND_INTERVAL_S,
        describe: str = "the MLflow run",
    ) -> None:
        self._send, self._capacity, self._flush_timeout = send, capacity, flush_timeout
        self._backoff, self._interval, self._describe = backoff, interval, describe
        self._flushing = 0  # flush() callers waiting: the interval does not hold them up
        self._last_send = -float("inf")
        self._buffer: collections.deque[MetricValue] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._sending = False
        self._in_flight = 0  # values in the batch being sent
        self.dropped = 0
        self.sent = 0
        self.outage: str | None = None
        #: Values lost at close: still buffered, or in a batch whose send failed after it.
        self.unsent = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchdist-mlflow-metrics", daemon=True)
        self._thread.start()

    def offer(self, record: dict[str, Any]) -> None:
        """Buffer a ``report()`` record's values; returns at once."""
        values = metric_values(record)
        with self._cond:
            if self._closing:
                return
            self._buffer.extend(values)
            over = len(self._buffer) - self._capacity
            for _ in range(max(over, 0)):
                self._buffer.popleft()
            self.dropped += max(over, 0)
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._buffer) + self._in_flight

    def _run(self) -> None:
        wait = self._backoff[0]
        while True:
            with self._cond:
                while (wait_for := self._send_due_in()) != 0.0:
                    self._cond.wait(wait_for)
                if not self._buffer:
                    return
                batch = [self._buffer.popleft() for _ in range(min(BATCH_SIZE, len(self._buffer)))]
                self._sending, self._in_flight = True, len(batch)
                self._last_send = time.monotonic()
            try:
                self._send(batch)
            except Exception as exc:
                if not self._failed(batch, exc):
                    return
                # Not the condition: an offer would wake it and hammer a server that is down.
                self._closed.wait(wait)
                wait = min(wait * 2, self._backoff[1])
                continue
            with self._cond:
                self._sending, self._in_flight = False, 0
                self.sent += len(batch)
                if self.outage is not None:
                    log.info(
                        "MLflow: %s answers again; the buffered metrics are being logged.", self._describe
                    )
                    self.outage = None
                wait = self._backoff[0]
                self._cond.notify_all()

    def _send_due_in(self) -> float | None:
        """Under the condition: 0 when the thread should send now (or end: closed, nothing left),
        else how long to wait (None: until an offer)."""
        if not self._buffer:
            return 0.0 if self._closing else None
        if self._closing or self._flushing or len(self._buffer) >= BATCH_SIZE:
            return 0.0
        return max(0.0, self._last_send + self._interval - time.monotonic())

    def _failed(self, batch: list[MetricValue], exc: Exception) -> bool:
        """Keep a batch that could not be sent; False when closed meanwhile (the batch is lost)."""
        with self._cond:
            self._sending, self._in_flight = False, 0
            if self.outage is None:
                self.outage = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.warning(
                    "MLflow: could not log metrics to %s (%s); buffering them (at most %d values) and "
                    "trying again. Training goes on.",
                    self._describe,
                    self.outage,
                    self._capacity,
                )
            if self._closing:
                self.unsent += len(batch)
                self._cond.notify_all()
                return False
            self._buffer.extendleft(reversed(batch))  # in order: they go first next time
            self._cond.notify_all()
            return True

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for everything buffered to be sent; True if it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._buffer or self._sending:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._cond.wait(min(left, 0.5))
                return True
            finally:
                self._flushing -= 1

    def close(self) -> int:
        """Flush (up to ``flush_timeout``), stop the thread, and say in the task log what was not
        logged; returns how many values were not."""
        self.flush(self._flush_timeout)
        with self._cond:
            self._closing = True
            self.unsent += len(self._buffer)
            self._buffer.clear()
            self._cond.notify_all()
        self._closed.set()
        # A send under way gets its own request timeout to finish (MLFLOW_HTTP_REQUEST_TIMEOUT).
        self._thread.join(timeout=15.0)
        lost = self.unsent + self.dropped
        if lost:
            log.warning(
                "MLflow: %d metric value(s) could not be logged to %s: %s.",
                lost,
                self._describe,
                f"the server did not answer ({self.outage})" if self.outage else "the buffer was full",
            )
        return lost
