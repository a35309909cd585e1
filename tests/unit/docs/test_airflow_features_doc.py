"""docs/airflow-features.md names, for each feature, the test that proves it: every test it names
exists (a renamed or removed test fails here, not in a reader's hands)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "airflow-features.md"
#: "``...::name``" in the table is short for this module.
SHORT = "integration/test_airflow_features.py"


def named_tests() -> list[tuple[str, str]]:
    found = []
    for path, name in re.findall(r"`((?:unit|integration)/[\w/]+\.py|\.\.\.)::(\w+)`", DOC.read_text()):
        found.append((SHORT if path == "..." else path, name))
    return found


def test_every_test_the_conformance_table_names_exists():
    named = named_tests()
    assert len(named) >= 15, named
    missing = []
    for path, name in named:
        source = ROOT / "tests" / path
        defined = (
            {n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.FunctionDef)}
            if source.exists()
            else set()
        )
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/airflow-features.md names tests that do not exist: {missing}"
