"""What the operator puts in XCom while it owns a run: the extra links' URLs as soon as the driver
reports them, the run's checkpoint directory, the metric history as it grows, the world sizes once
it has succeeded, and rank 0's output as the task's value.

:func:`link_pusher` is the hook's ``on_application`` for a task instance; :func:`metrics_pusher`
makes its ``on_metrics`` (a :class:`ThrottledPush`); :func:`output_handler` is what the hook's
``follow`` hands rank 0's output file to
(:func:`~airflow_provider_torchdist.outputs.results.output_to_xcom`: inline, or stored and signed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from airflow_provider_torchdist.links import LINK_XCOM_KEYS, ApplicationLinks
from airflow_provider_torchdist.outputs import run_paths
from airflow_provider_torchdist.outputs.results import origin_of, output_to_xcom
from airflow_provider_torchdist.spark.node.checkpoint_store import local_path
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.validation import checkpoint_dir_path
from airflow_provider_torchdist.supervision.lifeline.run_state import newest_that_fit

#: XCom key of the list of ``report()`` records: ``[{"rank": 0, "step": 3, "time": ..., "loss": 0.12}, ...]``.
METRICS_XCOM_KEY = "metrics"
#: XCom key of how the world size went over a succeeded run:
#: ``[{"time": 1767225600.1, "world_size": 4, "reason": "start"}, ...]`` (see ``hook.world_sizes``).
WORLD_SIZES_XCOM_KEY = "world_sizes"
#: XCom key of each rank's mean step time and compute share, when the hang watchdog is on:
#: ``[{"rank": 0, "time": ..., "mean_step_time_s": 0.17, "compute_share": 0.31}, ...]``.
RANK_STEP_TIMES_XCOM_KEY = "rank_step_times"
#: XCom key of the run's checkpoint directory, an absolute local path (``checkpoint_dir``, or this
#: task's default), pushed before the run is followed, so a downstream task need not rebuild it.
CHECKPOINT_DIR_XCOM_KEY = "checkpoint_dir"
#: The shortest time between two pushes of the growing metric history while a run trains.
METRICS_PUSH_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


def start_timer(delay: float, action: Callable[[], None]) -> Cancellable:
    """``action`` in a daemon thread after ``delay`` seconds (:class:`ThrottledPush`'s default)."""
    timer = threading.Timer(delay, action)
    timer.daemon = True
    timer.start()
    return timer


class ThrottledPush:
    """Push the newest of a growing value at most once per ``interval`` seconds.

    An offer pushes at once when the last push is ``interval`` old; otherwise it is kept, and a
    timer pushes the newest kept value when the interval is up, so nothing offered waits longer.
    :meth:`close` cancels that timer and pushes the final value: nothing pushes after it. A live
    push that fails is logged, never raised (the run goes on); thread-safe.

    Example::

        push = ThrottledPush(lambda history: ti.xcom_push(key="metrics", value=history))
        hook.on_metrics = push.offer
        ...
        push.close(hook.metrics)
    """

    def __init__(
        self,
        push: Callable[[Any], None],
        interval: float = METRICS_PUSH_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        schedule: Callable[[float, Callable[[], None]], Cancellable] = start_timer,
    ) -> None:
        self._push, self._interval, self._clock, self._schedule = push, interval, clock, schedule
        self._lock = threading.Lock()
        self._last: float | None = None
        self._kept: Any = None
        self._waiting = False
        self._timer: Cancellable | None = None
        self._closed = False

    def offer(self, value: Any) -> None:
        with self._lock:
            if self._closed:
                return
            self._kept, self._waiting = value, True
            now = self._clock()
            if self._last is None or now - self._last >= self._interval:
                self._push_kept(now)
            elif self._timer is None:
                self._timer = self._schedule(self._last + self._interval - now, self._due)

    def _due(self) -> None:
        with self._lock:
            self._timer = None
            if not self._closed and self._waiting:
                self._push_kept(self._clock())

    def _push_kept(self, now: float) -> None:
        self._last, self._waiting = now, False
        try:
            self._push(self._kept)
        except Exception as exc:
            log.warning("Could not push the live value: %s", exc)

    def close(self, final: Any = None) -> None:
        """No more live pushes; push ``final`` (unless None), after any push under way."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if final is not None:
                self._push(final)


def push_link_placeholders(ti: Any) -> None:
    """An empty URL under every link key, before the run starts. Airflow reads each extra link's
    XCom at the end of the try, and its API client logs a missing XCom at error level: a run whose
    application has no master or history page (or never started) would log errors otherwise."""
    for key in LINK_XCOM_KEYS:
        ti.xcom_push(key=key, value="")


def link_pusher(ti: Any) -> Callable[[ApplicationLinks], None]:
    """The hook's ``on_application`` that pushes the application's link URLs to ``ti``'s XCom."""

    def push_links(links: ApplicationLinks) -> None:
        # Pushed while the run goes on, so the extra links work before the task ends.
        for key, url in links.xcom_values().items():
            ti.xcom_push(key=key, value=url)

    return push_links


def metrics_pusher(ti: Any, interval: float = METRICS_PUSH_INTERVAL_S, **timing: Any) -> ThrottledPush:
    """What pushes the growing metric history to ``ti``'s XCom ``metrics`` while a run trains
    (:meth:`ThrottledPush.offer` is the hook's ``on_metrics``): the newest records that fit, as the
    run's final status holds them. ``close(history)`` is the final push, with the whole history.
    ``timing``: :class:`ThrottledPush`'s ``clock`` and ``schedule``, for tests."""

    def push(history: list[dict[str, Any]]) -> None:
        ti.xcom_push(key=METRICS_XCOM_KEY, value=newest_that_fit(history[:]))

    return ThrottledPush(push, interval, **timing)


def push_world_sizes(
    ti: Any, world_sizes: list[dict[str, Any]], rank_step_times: list[dict[str, Any]] | None = None
) -> None:
    """Push a succeeded run's world sizes to ``ti``'s XCom ``world_sizes``: one entry for a fixed
    world, one more per change for an elastic run (which of its nodes it lost or took in, when);
    and each rank's step time to ``rank_step_times``, when the run has them (the hang watchdog on)."""
    ti.xcom_push(key=WORLD_SIZES_XCOM_KEY, value=list(world_sizes))
    if rank_step_times:
        ti.xcom_push(key=RANK_STEP_TIMES_XCOM_KEY, value=list(rank_step_times))


def push_checkpoint_dir(ti: Any, spec: TrainingSpec) -> None:
    """Push the run's checkpoint directory (the plain path the ranks' ``checkpoint_dir()`` gives,
    or a remote store's URI) to ``ti``'s XCom ``checkpoint_dir``; nothing when the run has none."""
    if spec.checkpoint_dir:
        remote = local_path(spec.checkpoint_dir) is None
        value = spec.checkpoint_dir if remote else checkpoint_dir_path(spec.checkpoint_dir)
        ti.xcom_push(key=CHECKPOINT_DIR_XCOM_KEY, value=value)


def output_handler(ti: Any, spec: TrainingSpec) -> Callable[[Path | None], Any]:
    """What turns rank 0's output file into ``ti``'s XCom value, under ``spec``'s output settings."""
    store_uri = run_paths.output_uri(spec.output_path, ti)
    return lambda path: output_to_xcom(
        path,
        origin=origin_of(ti),
        max_inline_bytes=spec.max_xcom_output_bytes,
        store_uri=store_uri,
        store_base=run_paths.output_base(spec.output_path),
    )
