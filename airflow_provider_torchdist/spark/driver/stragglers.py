"""Stragglers: a rank slower than the others, found from the hang watchdog's progress messages, and
each rank's step time at the end of the run (see docs/hangs.md).

In synchronous training every rank's step takes as long as the slowest rank's: the others wait for
it in their collectives. So the step time alone names nobody; the *compute share* does: the share
of a rank's watchdog samples in which its main thread was not waiting in a torch.distributed call.
A rank slowed 3x computes nearly all the time while the others wait two thirds of theirs: its
compute share is 3x theirs. (Ranks that train without collectives each step, apart, differ in step
time instead; the larger of the two factors counts.)

:class:`StragglerCheck` compares each rank with the median of the others over the last
:data:`WINDOW_S`; a rank :data:`SLOWER_BY` times slower or more for :data:`SUSTAIN_S` is named in
the task log, once. :func:`step_time_records` are the records the driver adds to the run's metric
stream at the end: each rank's mean step time and compute share, which the task keeps apart from
the ``report()`` history (:func:`split_summaries`: XCom ``rank_step_times``). Standard library
only; no Airflow.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.driver.hang_detection import RankProgress

#: How many times slower than the others' median a rank must be to be named.
SLOWER_BY = 1.5
#: For how long, in seconds, before it is named (a slow checkpoint or evaluation step is not a straggler).
SUSTAIN_S = 20.0
#: The window, in seconds, over which compute shares and step times are compared.
WINDOW_S = 20.0
#: The fewest samples of a rank in the window for it to be compared at all (the watchdog samples
#: twice a second).
MIN_SAMPLES = 10
#: The metric names of the per-rank records added at the end of a run.
MEAN_STEP_TIME = "mean_step_time_s"
COMPUTE_SHARE = "compute_share"
#: What marks those records as the driver's (``{"summary": "step_time", ...}``): a string, which no
#: ``report()`` sends (its values are numbers), and the run channel refuses from a rank.
SUMMARY_FIELD, SUMMARY_KIND = "summary", "step_time"


class StragglerCheck:
    """Looks for stragglers whenever :meth:`check` is given every rank's state (each second, from the
    hang watch's thread); ``say`` prints a line in the task log."""

    def __init__(
        self, say: Callable[[str], None], *, slower_by: float = SLOWER_BY, sustain: float = SUSTAIN_S
    ) -> None:
        self._say, self.slower_by, self.sustain = say, slower_by, sustain
        self._seen: dict[int, deque[tuple[float, int, int, int]]] = {}
        self._slow_since: dict[int, float] = {}
        #: The ranks named so far, each once.
        self.named: list[int] = []

    def _window(self, state: RankProgress, now: float) -> tuple[int, int, int, float] | None:
        """``(samples, busy, events, seconds)`` of ``state`` over the last :data:`WINDOW_S`."""
        seen = self._seen.setdefault(state.rank, deque())
        seen.append((now, state.samples, state.busy, state.events))
        while len(seen) > 2 and now - seen[1][0] >= WINDOW_S:
            seen.popleft()
        (t0, s0, b0, e0), (t1, s1, b1, e1) = seen[0], seen[-1]
        if s1 - s0 < MIN_SAMPLES or t1 - t0 < WINDOW_S / 2:
            return None
        return s1 - s0, b1 - b0, e1 - e0, t1 - t0

    def check(self, ranks: list[RankProgress], now: float | None = None) -> list[int]:
        """Compare the ranks once; returns those named this time."""
        now = time.monotonic() if now is None else now
        windows = {s.rank: w for s in ranks if (w := self._window(s, now)) is not None}
        if len(windows) < 2:
            return []
        share = {r: busy / samples for r, (samples, busy, _, _) in windows.items()}
        step = {r: seconds / events for r, (_, _, events, seconds) in windows.items() if events > 0}
        named = []
        for state in ranks:
            factor = _slower_than_the_others(state.rank, share, step)
            if factor is None or factor < self.slower_by:
                self._slow_since.pop(state.rank, None)
                continue
            since = self._slow_since.setdefault(state.rank, now)
            if now - since >= self.sustain and state.rank not in self.named:
                self.named.append(state.rank)
                named.append(state.rank)
                others = statistics.median(v for r, v in share.items() if r != state.rank)
                self._say(
                    f"straggler: {state.prefix} has run {factor:.1f}x slower than the other ranks for "
                    f"{now - since:.0f} s: it computes {share[state.rank]:.0%} of the time while the others "
                    f"wait in collectives {1 - others:.0%} of theirs (now at {state.where}). The run goes "
                    "on; a slow host, a data loader or uneven work on that rank would do this."
                )
        return named


def _slower_than_the_others(rank: int, share: dict[int, float], step: dict[int, float]) -> float | None:
    """How many times slower ``rank`` is than the median of the others: by compute share, or by
    step time where the ranks step apart; None when it cannot be told."""
    factors = []
    others = [v for r, v in share.items() if r != rank]
    if rank in share and others and (median := statistics.median(others)) > 0:
        factors.append(share[rank] / median)
    others = [v for r, v in step.items() if r != rank]
    if rank in step and others and (median := statistics.median(others)) > 0:
        factors.append(step[rank] / median)
    return max(factors) if factors else None


def is_rank_summary(record: Any) -> bool:
    """Whether a metrics record is one of :func:`step_time_records`' (the driver's: a rank's step
    time), not a ``report()``."""
    return isinstance(record, dict) and record.get(SUMMARY_FIELD) == SUMMARY_KIND


def split_summaries(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(reports, rank step times)`` of a run's metrics: the run's channel carries both, the task
    keeps them apart (XCom ``metrics`` and ``rank_step_times``)."""
    reports = [r for r in records if not is_rank_summary(r)]
    return reports, [r for r in records if is_rank_summary(r)]


def step_time_records(ranks: list[RankProgress]) -> list[dict[str, Any]]:
    """One metrics record per rank that made progress: ``{"rank", "time", "summary": "step_time",
    "mean_step_time_s", "compute_share"}``, which the task keeps apart from the reports."""
    records = []
    for state in ranks:
        values: dict[str, Any] = {}
        if (mean := state.mean_step_time_s) is not None:
            values[MEAN_STEP_TIME] = round(mean, 6)
        if state.samples:
            values[COMPUTE_SHARE] = round(state.busy / state.samples, 4)
        if values:
            records.append({"rank": state.rank, "time": time.time(), SUMMARY_FIELD: SUMMARY_KIND, **values})
    return records
