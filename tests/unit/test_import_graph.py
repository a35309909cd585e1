"""The package's modules import each other without a cycle.

The graph is built from the source, not by importing it: every ``import`` and ``from ... import``
of every module, at any depth (function-level imports included, since they run too), except those
under ``if TYPE_CHECKING:``, which never run. ``from pkg import name`` counts as importing
``pkg.name`` when that is a module, else ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import airflow_provider_torchdist

PACKAGE = "airflow_provider_torchdist"
ROOT = Path(airflow_provider_torchdist.__file__).parent


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:  # only the ``else:`` branch runs
                found += _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        found += _imports(node)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> the package's modules it imports``."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: ``from . import x``, ``from ..spark import y``
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(module_files())
    assert "airflow_provider_torchdist.spark.driver.channel" in graph  # the graph is really built
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_report_reaches_the_ranks_client_without_importing_rank():
    graph = import_graph(module_files())
    spark = "airflow_provider_torchdist.spark"
    assert f"{spark}.node.rank_context" in graph[f"{spark}.node.metrics"]
    assert f"{spark}.node.rank" not in graph[f"{spark}.node.metrics"]


def test_a_cycle_is_found(tmp_path):
    """The checker itself: a function-level import that closes a loop is a cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert graph["pkg.d"] == set()  # TYPE_CHECKING imports never run


def test_the_airflow_side_imports_no_torch() -> None:
    """torch is optional on the Airflow side (README: install): a DAG with the operator parses, and
    the operator, hook, trigger and output helpers import, in a Python where torch cannot import."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from airflow.sdk import DAG
from airflow_provider_torchdist import TorchDistributorHook, TorchDistributorOperator, load_output
from airflow_provider_torchdist.triggers.torch_distributor import TorchDistributorTrigger
from airflow_provider_torchdist.doctor import run_checks

def train():
    return 1

with DAG("no_torch", schedule=None):
    TorchDistributorOperator(task_id="t", train_object=train, num_processes="{{ params.n }}", local_mode=False)
TorchDistributorHook(num_processes=2)
print({f.what: f.ok for f in run_checks()}["torch"])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"  # doctor names the missing torch
