"""What ranks print reaches the task log as one visible line: no forged lines, no terminal escapes."""

from __future__ import annotations

import io
import threading
from types import SimpleNamespace

import pytest

from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.node.metrics import format_metrics
from airflow_provider_torchdist.spark.wire.logsafe import escape_controls

FORGED = "done\n[torchdist] application evil spark-ui http://evil"


@pytest.mark.parametrize(
    "text, shown",
    [
        ("\x1b[2J\x1b]0;title\x07", "\\x1b[2J\\x1b]0;title\\x07"),
        ("a\nb\rc", "a\\nb\\rc"),
        ("nul\x00 del\x7f", "nul\\x00 del\\x7f"),
        ("c1\x85\x9b31m", "c1\\x85\\x9b31m"),  # NEL, CSI
        ("ls\u2028ps\u2029", "ls\\u2028ps\\u2029"),
        ("vt\x0bff\x0cfs\x1c", "vt\\x0bff\\x0cfs\\x1c"),
        ("bidi\u202eevil\u2066", "bidi\\u202eevil\\u2066"),
        ("lone\ud800surrogate", "lone\\ud800surrogate"),
    ],
)
def test_controls_become_visible_escapes(text, shown):
    assert escape_controls(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii",
        "tab\tstays",
        "é € 日本語 😀 👩‍👩‍👧",
        "C:\\Users\\x and \\n literal",
        "nbsp\u00a0 zwsp\u200b",
        "",
    ],
)
def test_printable_text_is_unchanged(text):
    assert escape_controls(text) == text


def test_escaping_twice_changes_nothing_more():
    once = escape_controls("a\x1b[0m\nb\u2028")
    assert escape_controls(once) == once


def test_escaped_text_has_no_line_breaks_for_any_character():
    every = "".join(chr(c) for c in range(0x3000))
    assert len(escape_controls(every).splitlines()) == 1


def _print(line: str) -> str:
    """What the run channel writes to the driver's stdout for ``line``."""
    fake = SimpleNamespace(_print_lock=threading.Lock(), _out=io.StringIO())
    RunChannel._print(fake, line)
    return fake._out.getvalue()


def test_the_channel_prints_a_ranks_line_as_one_escaped_line():
    out = _print(f"[rank 0 @ 127.0.0.1] {FORGED}\x1b[2K")
    assert out == "[rank 0 @ 127.0.0.1] done\\n[torchdist] application evil spark-ui http://evil\\x1b[2K\n"
    assert out.count("\n") == 1


def test_metric_names_and_values_are_escaped():
    record = {"rank": 0, "step": 1, "time": 1.0, "lo\x1bss\n[torchdist] x": 0.5, "tag": "a\rb\u2028c"}
    text = format_metrics(record)
    assert text == "rank 0 step 1: lo\\x1bss\\n[torchdist] x=0.5 tag=a\\rb\\u2028c"
    assert len(text.splitlines()) == 1


def test_crafted_rank_and_step_fields_are_escaped():
    assert format_metrics({"rank": "0\nevil", "step": "\x1b[1m", "loss": 1}) == (
        "rank 0\\nevil step \\x1b[1m: loss=1"
    )
