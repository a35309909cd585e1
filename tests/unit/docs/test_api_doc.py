"""The API page renders the docstrings' Sphinx markup as Markdown, and shows public names only.

The page is built for real (``mkdocs build --strict``, as CI builds the site) and its HTML read:
no ``:func:``-style role and no ``Example::`` is printed, every documented object is a public name
(``airflow_provider_torchdist.__all__``, the framework callbacks, the errors, and the hook's own
methods), and every name in ``__all__`` is there.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import airflow_provider_torchdist
from airflow_provider_torchdist import callbacks, errors

ROOT = Path(__file__).resolve().parents[3]
#: The hook's methods a user calls; its other public-looking methods are the operator's.
HOOK_METHODS = {"run", "start_run", "follow", "detach", "stop_run"}


def sphinx_markup() -> ModuleType:
    path = ROOT / "docs" / "tools" / "griffe_sphinx_markup.py"
    spec = importlib.util.spec_from_file_location("griffe_sphinx_markup", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_names() -> set[str]:
    """The dotted paths (where each is defined) the API page may document."""
    names = set()
    for name in airflow_provider_torchdist.__all__:
        obj = getattr(airflow_provider_torchdist, name)
        names.add(f"{obj.__module__}.{obj.__qualname__}")
    names |= {f"airflow_provider_torchdist.callbacks.{name}" for name in callbacks.__all__}
    names.add("airflow_provider_torchdist.errors")
    names |= {
        f"airflow_provider_torchdist.errors.{name}"
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and obj.__module__ == errors.__name__
    }
    hook = airflow_provider_torchdist.TorchDistributorHook
    names |= {f"{hook.__module__}.{hook.__qualname__}.{method}" for method in HOOK_METHODS}
    return names


def test_sphinx_roles_and_literal_blocks_become_markdown() -> None:
    tool = sphinx_markup()
    doc = (
        "Decode with :func:`~airflow_provider_torchdist.load_output` or :class:`pkg.Hook`.\n\n"
        "Example::\n\n    x = run(1)\n    if x:\n        print(x)\n\nAfter.\n\n"
        "::\n\n    bare()\n"
    )
    assert tool.to_markdown(doc) == (
        "Decode with `load_output` or `pkg.Hook`.\n\n"
        "Example:\n\n```python\nx = run(1)\nif x:\n    print(x)\n```\n\nAfter.\n\n\n```python\nbare()\n```\n"
    )


@pytest.fixture(scope="module")
def api_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert not (site / "tools").exists(), "the docs' generators are not part of the site"
    return (site / "api" / "index.html").read_text()


def test_the_api_page_prints_no_sphinx_markup(api_page: str) -> None:
    text = re.sub(r"<[^>]+>", "", api_page)
    assert "load_output" in text and "TrainingFailed" in text
    leftovers = re.findall(r":(?:func|class|meth|mod|attr|data|exc|obj):`?[\w.~]*|\w+::", text)
    assert leftovers == [], f"raw Sphinx markup on the API page: {sorted(set(leftovers))}"
    assert "Example:" in text and "<pre" in api_page  # the example is a code block


def test_the_api_page_shows_public_names_only_and_all_of_them(api_page: str) -> None:
    documented = set(re.findall(r'id="(airflow_provider_torchdist\.[\w.]+)"', api_page))
    public = public_names()
    assert documented - public == set(), "internal names on the API page"
    missing = {
        name
        for name in public
        if name.rsplit(".", 1)[-1] in airflow_provider_torchdist.__all__ or ".hooks." in name
    } - documented
    assert missing == set(), "public names missing from docs/api.md"
    assert not re.search(
        r"SupervisedRunMixin|run_control|shard_file|for_cluster", re.sub(r"<[^>]+>", "", api_page)
    )
