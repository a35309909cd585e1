"""When each xdist worker ran each unit of work (a test file, or the shared set-ups' files), printed
at the end of the run: the slowest worker's line is the suite's critical path, which the
``--durations`` list alone does not show. Hooks for ``conftest.py``; the controller gathers the
workers' reports (their ``start`` and ``stop`` times)."""

from __future__ import annotations

from typing import Any

import pytest

#: (worker, unit of work) -> [first start, last stop], in epoch seconds.
_SPANS: dict[tuple[str, str], list[float]] = {}


def record(report: pytest.TestReport, scope: str) -> None:
    """Widen the span of ``report``'s worker and unit by its phase (in the controller only)."""
    worker = getattr(report, "worker_id", None)  # what xdist's workers add to their reports
    start, stop = getattr(report, "start", None), getattr(report, "stop", None)
    if worker is None or start is None or stop is None:
        return  # not an xdist run, or a report without times
    span = _SPANS.setdefault((worker, scope), [start, stop])
    span[0], span[1] = min(span[0], start), max(span[1], stop)


def summary(terminal: Any) -> None:
    """One line per worker: its units in the order they ran, minutes from the first test's start."""
    if not _SPANS:
        return
    origin = min(start for start, _ in _SPANS.values())

    def minutes(t: float) -> str:
        seconds = int(t - origin)
        return f"{seconds // 60}:{seconds % 60:02d}"

    terminal.write_sep("=", "what each worker ran, and when (m:ss from the first test)")
    for worker in sorted({w for w, _ in _SPANS}):
        units = sorted((span, scope) for (w, scope), span in _SPANS.items() if w == worker)
        end = max(stop for (_, stop), _ in units)
        parts = [f"{scope.rpartition('/')[2]} {minutes(a)}-{minutes(b)}" for (a, b), scope in units]
        terminal.write_line(f"{worker} (done {minutes(end)}): " + ", ".join(parts))
