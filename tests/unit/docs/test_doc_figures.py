"""Benchmark figures come from one place, ``bench/results/latest.json``.

``docs/benchmarks.md`` and the README's summary are rendered from it by ``bench/report.py``; a figure
quoted anywhere else sits between ``<!-- figure: ... -->`` markers that ``bench/figures.py`` fills in.
A page that states a figure the results do not hold fails here, naming the page and the figure.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
#: A measured ratio ("1.84 x raw torchrun", "1.41×"): only ever from the results.
RATIO = re.compile(r"\b\d+\.\d+ ?(?:×|x\b)")
#: A decimal number of seconds. In the guide's pages every one is a measurement, so it must be a
#: marked figure, except these, which are not measurements (a poll interval, a sample log line).
SECONDS = re.compile(r"\b\d+\.\d+ s\b")
NOT_MEASURED = ("within 0.1 s", "ended 1.2 s after the stop request")


def bench_module(name: str) -> ModuleType:
    """A module of ``bench/`` (which is not a package: its scripts import each other by name)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    found = bench_module("common").load_results()
    assert found.get("launch"), "bench/results/latest.json holds the launch results"
    return found


def unmarked(text: str) -> str:
    """The text a person wrote: less the generated blocks, the marked figures and code."""
    text = re.sub(re.escape(START) + ".*?" + re.escape(END), "", text, flags=re.S)
    text = bench_module("figures").FIGURE.sub("", text)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def stale_figures(page: Path, text: str, results: dict[str, Any]) -> list[str]:
    """What is wrong with the figures ``text`` (the page ``page``) states."""
    figures = bench_module("figures")
    problems = [
        f"{page.name}: {old!r} should be {new!r}"
        for old, new in zip(
            figures.FIGURE.findall(text),
            figures.FIGURE.findall(figures.render_figures(text, results)),
            strict=True,
        )
        if old != new
    ]
    bare = unmarked(text)
    problems += [f"{page.name}: {ratio!r} is not a marked figure" for ratio in RATIO.findall(bare)]
    if "design" not in page.parts:  # design records keep the figures of their time
        for line in bare.splitlines():
            if SECONDS.search(line) and not any(allowed in line for allowed in NOT_MEASURED):
                problems += [
                    f"{page.name}: {s!r} is not a marked figure ({line.strip()[:80]})"
                    for s in SECONDS.findall(line)
                ]
    return problems


def test_every_figure_in_the_docs_is_the_bench_results(results: dict[str, Any]) -> None:
    problems = []
    pages = bench_module("figures").pages(ROOT)
    assert ROOT / "docs" / "connections.md" in pages
    for page in pages:
        if page.name != "benchmarks.md":  # rendered whole from the results: the next test
            problems += stale_figures(page, page.read_text(), results)
    assert problems == [], (
        "run `python bench/report.py`, or mark the figure (bench/figures.py):\n" + "\n".join(problems)
    )


def test_the_benchmarks_page_and_the_readme_summary_are_the_results(results: dict[str, Any]) -> None:
    report = bench_module("report")
    for path, body in ((report.DOC, report.render(results)), (report.README, report.render_summary(results))):
        text = path.read_text()
        assert text.split(START, 1)[1].split(END, 1)[0] == f"\n{body}\n", (
            f"{path.name} is not what bench/report.py renders from the results: run `python bench/report.py`"
        )


def test_a_stale_or_unmarked_figure_is_found(results: dict[str, Any]) -> None:
    """The case of issue 41: connections.md said 1.84 x where the results say 1.41 x."""
    page = ROOT / "docs" / "page.md"
    marked = "a launch takes <!-- figure: launch-ratio hook_distributed/torchrun -->1.84 x<!-- /figure -->"
    assert stale_figures(page, marked, results) == [
        "page.md: ('launch-ratio', 'hook_distributed/torchrun', '1.84 x') should be "
        "('launch-ratio', 'hook_distributed/torchrun', '1.41 x')"
    ]
    assert stale_figures(page, "| launch | 1.84 x raw torchrun |", results) == [
        "page.md: '1.84 x' is not a marked figure"
    ]
    assert stale_figures(page, "it starts 1.2 s sooner", results) == [
        "page.md: '1.2 s' is not a marked figure (it starts 1.2 s sooner)"
    ]
    assert stale_figures(page, "in code: `0.5 s` and a ratio `2.00 x`", results) == []


def test_an_unknown_figure_is_refused(results: dict[str, Any]) -> None:
    figures = bench_module("figures")
    with pytest.raises(figures.UnknownFigure, match="unknown figure 'launch'"):
        figures.render_figures("<!-- figure: launch -->1 s<!-- /figure -->", results)
    with pytest.raises(figures.UnknownFigure, match="no ratio 'hook_local/ray'"):
        figures.render_figures("<!-- figure: launch-ratio hook_local/ray -->1 x<!-- /figure -->", results)
