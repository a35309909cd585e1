"""A rank's progress events, counted for its hang watchdog (:mod:`.watchdog`).

``report()``, ``stop_requested()`` and the Lightning and Hugging Face callbacks' steps call
:func:`note_progress`; the watchdog thread reads the count and the mean gap between events
(:func:`take`). It costs a lock and a clock read per event. Standard library only.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_events = 0
_last: float | None = None
#: The gaps between events since the last :func:`take`: their sum and how many.
_gap_sum = 0.0
_gaps = 0
#: Set once the user's code has returned (or raised): what the rank does after it is the runtime's
#: (sending rank 0's output, waiting for an elastic regroup), never a hang of the user's.
work_done = threading.Event()


def note_progress() -> None:
    """This rank made progress: one more event (a report, a stop check, a step)."""
    global _events, _last, _gap_sum, _gaps
    now = time.monotonic()
    with _lock:
        _events += 1
        if _last is not None:
            _gap_sum += now - _last
            _gaps += 1
        _last = now


def take() -> tuple[int, float | None]:
    """The events counted so far, and the mean seconds between two of those since the last call
    (None with fewer than two)."""
    global _gap_sum, _gaps
    with _lock:
        mean = _gap_sum / _gaps if _gaps else None
        _gap_sum, _gaps = 0.0, 0
        return _events, mean
