"""A task's ``execution_timeout`` over the whole of its run, deferred time and resumed tries included.

Airflow's task runner applies ``execution_timeout`` only around ``execute()`` (and afresh around
each resumed method): a deferred run would train on past it, and a resumed try would get a new one.
So the try that starts a run writes the moment its timeout ends into the run's record
(:attr:`~airflow_provider_torchdist.supervision.record.RunRecord.deadline`), and every owner of the run
holds to that moment:

- the task process, while it follows the run (:class:`DeadlineWatch`: a timer that stops the run);
- the trigger, while the task is deferred
  (:class:`~airflow_provider_torchdist.triggers.torch_distributor.TorchDistributorTrigger`);
- a try resumed after a deferral, or a durable retry that takes the run over: the same record,
  so only what is left of the timeout.

A run stopped by its deadline fails the try with :class:`AirflowTaskTimeout` naming the run.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

from airflow.providers.common.compat.sdk import AirflowTaskTimeout

#: How long after a deferred run's deadline Airflow's own trigger timeout fails the task, should
#: the trigger not have ended the run itself (a triggerer down at that moment).
TRIGGER_TIMEOUT_MARGIN_S = 30.0
#: The longest a stop at the deadline may take before the task goes on without waiting for it.
STOP_WAIT_S = 20.0


def try_deadline(ti: Any, execution_timeout: dt.timedelta | None, now: float | None = None) -> float | None:
    """When this try's ``execution_timeout`` ends (seconds since the epoch): from the try's start
    (``ti.start_date``, which Airflow keeps across a deferral), or from now when it has none."""
    if execution_timeout is None:
        return None
    start = getattr(ti, "start_date", None)
    begun = start.timestamp() if isinstance(start, dt.datetime) else (time.time() if now is None else now)
    return begun + execution_timeout.total_seconds()


def seconds_left(deadline: float | None, now: float | None = None) -> float | None:
    """What is left until ``deadline`` (never below 0), or None without one."""
    if deadline is None:
        return None
    return max(0.0, deadline - (time.time() if now is None else now))


def timeout_error(
    run_id: str, deadline: float | None, where: str, stop_report: str = ""
) -> AirflowTaskTimeout:
    """The try's failure when its run was stopped at its deadline (``where``: "while deferred", ...;
    ``stop_report``: how the stop went, when whoever stopped it saw)."""
    at = ""
    if deadline is not None:
        at = f" ({dt.datetime.fromtimestamp(deadline, dt.UTC).isoformat(timespec='seconds')})"
    how = f" How the stop went: {stop_report.strip()}." if stop_report.strip() else ""
    return AirflowTaskTimeout(
        f"Run {run_id} passed the task's execution_timeout{at} {where}: the run was stopped.{how} "
        "Raise execution_timeout, or checkpoint so that a retry resumes where it stopped."
    )


class DeadlineWatch:
    """Calls ``on_expiry`` once, from a timer thread, when ``deadline`` passes inside the block;
    ``expired`` says whether it stopped the run (``on_expiry`` returns False when there was
    nothing to stop: the run had ended). No deadline: nothing happens. Leaving the block waits
    for an ``on_expiry`` under way, so the stop is sent before the task goes on.

    Example::

        with DeadlineWatch(record.deadline, lambda: hook.stop_run(record)) as watch:
            hook.follow(record, handle)   # ends once the stopped run has ended
        if watch.expired: raise timeout_error(...)
    """

    def __init__(self, deadline: float | None, on_expiry: Callable[[], Any]) -> None:
        self.deadline = deadline
        self._on_expiry = on_expiry
        self._expired = threading.Event()
        self._timer: threading.Timer | None = None

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    def _fire(self) -> None:
        # Set first: the stop ends the follow, whose error handler reads it at once.
        self._expired.set()
        if self._on_expiry() is False:
            self._expired.clear()

    def __enter__(self) -> DeadlineWatch:
        left = seconds_left(self.deadline)
        if left is not None:
            self._timer = threading.Timer(min(left, threading.TIMEOUT_MAX), self._fire)
            self._timer.daemon = True
            self._timer.name = "torchdist-deadline"
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(STOP_WAIT_S)
