"""Benchmark figures quoted in the prose of the docs, filled in from ``bench/results/latest.json``.

A page quotes a figure between markers that name it::

    spark-submit starts <!-- figure: supervisor-exec-cost -->1.37 s<!-- /figure --> sooner

:func:`render_figures` rewrites what is between the markers from the results, so a figure in the
docs is always the one the benchmarks measured last: ``python bench/report.py`` re-renders them
with the full results, and ``tests/unit/docs/test_doc_figures.py`` fails when a page's figure is
not the results' (or when a page states a launch ratio outside the markers). Standard library only:
the unit tests import this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``<!-- figure: NAME [ARG] -->text<!-- /figure -->``: the text is the figure NAME gives for ARG (one
#: line, no code span or tag: so a page can name the markers in code without being one).
FIGURE = re.compile(r"<!-- figure: ([\w-]+)(?: ([^ >]+))? -->([^`<\n]*)<!-- /figure -->")


class UnknownFigure(ValueError):
    """A page names a figure this module does not know, or one the results do not hold."""


def _launch_ratio(results: dict[str, Any], pair: str | None) -> str:
    """``NUM/DEN`` of ``bench/launch.py``'s recorded ratios of medians, such as
    ``hook_distributed/torchrun``: ``1.41 x``."""
    numerator, _, denominator = (pair or "").partition("/")
    for ratio in results.get("launch", {}).get("ratios", []):
        if (ratio["numerator"], ratio["denominator"]) == (numerator, denominator):
            return f"{ratio['ratio']:.2f} x"
    raise UnknownFigure(f"bench/results/latest.json's launch section has no ratio {pair!r}")


def _profile(results: dict[str, Any], mode: str) -> dict[str, Any]:
    medians = results.get("profile", {}).get("medians", {})
    if mode not in medians:
        raise UnknownFigure(f"bench/results/latest.json's profile section has no {mode!r} run")
    return medians[mode]


def _supervisor_exec_cost(results: dict[str, Any], _: str | None) -> str:
    """What a supervisor started as a new interpreter (``supervisor_start = exec``) adds to a run
    over one forked from the task: ``bench/profile_launch.py``'s two variants, same rounds."""
    cost = _profile(results, "supervised+exec")["total"] - _profile(results, "supervised")["total"]
    return f"{cost:.2f} s"


def _spark_stop(results: dict[str, Any], _: str | None) -> str:
    """Spark's stop at the end of a distributed launch (``SparkContext.stop``, the driver's and the
    JVM's exits), which the operator's path no longer waits for."""
    phases = _profile(results, "distributed")
    return f"{phases['sc_stop'] + phases['driver_exit'] + phases['jvm_exit']:.2f} s"


def _tracking_ratio(results: dict[str, Any], _: str | None) -> str:
    """Steady-state steps/s with MLflow tracking on over off (``bench/tracking.py``), the median of
    the interleaved rounds' ratios (robust to load that drifts between rounds): ``0.995 x``."""
    ratio = results.get("tracking", {}).get("median_paired_ratio")
    if ratio is None:
        raise UnknownFigure("bench/results/latest.json has no tracking section with a ratio")
    return f"{ratio:.3f} x"


#: Every figure a page may quote, by name.
FIGURES: dict[str, Callable[[dict[str, Any], str | None], str]] = {
    "launch-ratio": _launch_ratio,
    "supervisor-exec-cost": _supervisor_exec_cost,
    "spark-stop": _spark_stop,
    "tracking-ratio": _tracking_ratio,
}


def render_figures(text: str, results: dict[str, Any]) -> str:
    """``text`` with every marked figure filled in from ``results``."""

    def fill(match: re.Match[str]) -> str:
        name, arg = match[1], match[2]
        if name not in FIGURES:
            raise UnknownFigure(f"unknown figure {name!r} (known: {', '.join(FIGURES)})")
        spaced = f" {arg}" if arg else ""
        return f"<!-- figure: {name}{spaced} -->{FIGURES[name](results, arg)}<!-- /figure -->"

    return FIGURE.sub(fill, text)


def pages(repo: Path) -> list[Path]:
    """The pages that may quote figures: the README and every page of the docs."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def render_pages(repo: Path, results: dict[str, Any]) -> list[Path]:
    """Re-render the figures of every page; the pages that changed."""
    changed = []
    for page in pages(repo):
        text = page.read_text()
        rendered = render_figures(text, results)
        if rendered != text:
            page.write_text(rendered)
            changed.append(page)
    return changed
