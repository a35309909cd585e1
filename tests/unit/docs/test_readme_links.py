"""The README is the front door: every link in it leads somewhere.

The docs site's own links are checked by ``mkdocs build --strict`` (scripts/test); the README is
outside the site, so its relative links, and their anchors into the docs pages, are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page, as the docs site (Python-Markdown's toc) makes them."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            text = re.sub(r"[`*]", "", line.lstrip("#").strip().lower())
            found.add(re.sub(r"\s+", "-", re.sub(r"[^\w\- ]", "", text)).strip("-"))
    return found


def broken_links(readme: Path) -> list[str]:
    broken = []
    for target in LINK.findall(readme.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = readme.parent / path if path else readme
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading")
    return broken


def test_every_link_in_the_readme_leads_somewhere() -> None:
    assert LINK.findall((ROOT / "README.md").read_text())  # the README really has links
    assert broken_links(ROOT / "README.md") == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text("# Page\n\n## GPU settings\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[a](page.md) [b](page.md#gpu-settings) [c](gone.md) [d](page.md#nothing) [e](https://x.org)\n"
    )
    assert broken_links(readme) == ["gone.md: no such file", "page.md#nothing: no such heading"]


def test_the_contributor_page_names_only_what_exists() -> None:
    """docs/contributing.md answers where things go by path and by name: each must still be there."""
    import re

    page = (ROOT / "docs" / "contributing.md").read_text()
    paths = set(re.findall(r"`(airflow_provider_torchdist/[\w/]+\.py)`", page))
    assert len(paths) >= 8, "the page names the modules it sends a reader to"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == [], f"docs/contributing.md names modules that do not exist: {missing}"
    named = {
        "spec.py": ["class TrainingSpec"],
        "submit/spark_submit.py": ["class Submission", "def run(", "def kill("],
        "submit/connect.py": ["class ConnectSubmission", "def submission_for", "def run(", "def kill("],
        "spark/node/metrics.py": ["def report("],
        "spark/data/rank_data.py": ["def rank_shard(", "def rank_batches("],
    }
    for module, names in named.items():
        source = (ROOT / "airflow_provider_torchdist" / module).read_text()
        for name in names:
            assert name in source, f"docs/contributing.md says {module} holds {name!r}"
