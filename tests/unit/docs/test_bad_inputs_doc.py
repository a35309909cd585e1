"""docs/bad-inputs.md: its rows are numbered 1, 2, 3 ... in the order they appear, so "row 26" and
"rows 30–32" in the text find what they mean (rows were once numbered 64, 65, 67, 68, 66)."""

from __future__ import annotations

import re
from pathlib import Path

BAD_INPUTS = Path(__file__).resolve().parents[3] / "docs" / "bad-inputs.md"


def test_rows_are_numbered_in_order() -> None:
    numbers = [int(m) for m in re.findall(r"^\| (\d+) \|", BAD_INPUTS.read_text(), flags=re.MULTILINE)]
    assert numbers == list(range(1, len(numbers) + 1))
