"""The package's shape, checked: imports go down the layers, and modules and functions stay small.

The layers, top first, are the subpackages (and the few modules at the root) named in
:data:`LAYERS`; each subpackage's ``__init__`` says its job and what it may import. A module may
import its own layer and the layers below it, never one above. The package's root
(``airflow_provider_torchdist/__init__.py``) may be imported from anywhere: it imports nothing
eagerly (its public names load on first use).

A module over :data:`MODULE_LINES` lines, or a function over :data:`FUNCTION_LINES`, needs a
``# size:`` comment saying why: at the top of the module, or on the line above the ``def``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_import_graph import PACKAGE, ROOT, import_graph, module_files

#: Top first. A name is a subpackage or a module at the package's root.
LAYERS: list[set[str]] = [
    {"__main__", "get_provider_info", "doctor"},  # entry points and tools
    {"ui"},  # the Training view
    {"decorators"},  # @task.torch_distributor: the operator for a TaskFlow function
    {"operators"},  # the task: rendering, orchestration, XCom, lineage, assets
    {"triggers"},  # the deferred task's wait
    {"hooks"},  # the hook: plans and submits
    {"supervision"},  # the run's lifetime: supervisor, lifeline, record
    {"submit"},  # settings checks, plan, staging, engines
    {"outputs"},  # the output envelope, its signature and storage
    {"errors", "links"},  # what every Airflow-side layer shares
    {"callbacks"},  # framework callbacks, in the ranks
    {"spark"},  # the driver, the ranks and the data: no Airflow
    {"spec"},  # the one typed spec, shipped to the cluster
]
#: Inside ``spark/``, the same rule, top first (``app`` is the application spark-submit runs).
SPARK_LAYERS: list[set[str]] = [
    {"connect"},  # the driver over Spark Connect
    {"app"},  # the driver application: local, distributed and elastic runs
    {"data", "elastic"},  # train_data; elastic world sizes
    {"driver"},  # the driver's SparkContext, run channel and scheduler views
    {"node"},  # the barrier task, torchrun's agent and the ranks
    {"wire"},  # messages, files and their formats
]
MODULE_LINES = 300
FUNCTION_LINES = 60
SIZE_REASON = "# size:"


def layer_of(module: str, package: str = PACKAGE) -> str | None:
    """The layer name of a dotted module name inside ``package`` (None for the package itself, or a
    module outside it)."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def rank_of(name: str, layers: list[set[str]] = LAYERS) -> int:
    for rank, layer in enumerate(layers):
        if name in layer:
            return rank
    raise AssertionError(f"{name!r} is in no layer: add it to the layers in {__file__}")


def upward_imports(
    graph: dict[str, set[str]], package: str = PACKAGE, layers: list[set[str]] = LAYERS
) -> list[str]:
    """Every import, among ``package``'s modules, of a module in a higher layer than the importer's."""
    found = []
    for source, targets in sorted(graph.items()):
        here = layer_of(source, package)
        if here is None:
            continue
        for target in sorted(targets):
            there = layer_of(target, package)
            if there is not None and rank_of(there, layers) < rank_of(here, layers):
                found.append(f"{source} ({here}) imports {target} ({there})")
    return found


def test_every_root_entry_is_in_a_layer() -> None:
    entries = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    entries.discard("__init__")
    for name in sorted(entries):
        rank_of(name)
    assert len(entries) <= 16, sorted(entries)  # the architecture, not a flat list of modules


def test_imports_go_down_the_layers() -> None:
    graph = import_graph(module_files())
    assert f"{PACKAGE}.operators.torch_distributor" in graph  # the graph is really built
    assert upward_imports(graph) == []


def test_imports_go_down_the_layers_inside_spark() -> None:
    graph = import_graph(module_files())
    spark = f"{PACKAGE}.spark"
    assert f"{spark}.node.rank" in graph  # the graph is really built
    for entry in (ROOT / "spark").iterdir():
        if (entry.suffix == ".py" and entry.stem != "__init__") or (entry / "__init__.py").exists():
            rank_of(entry.stem, SPARK_LAYERS)
    assert upward_imports(graph, spark, SPARK_LAYERS) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    """The checker itself: the hook layer importing the operator layer is refused."""
    graph = {
        f"{PACKAGE}.hooks.x": {f"{PACKAGE}.operators.y", f"{PACKAGE}.submit.z"},
        f"{PACKAGE}.operators.y": {f"{PACKAGE}.hooks.x", PACKAGE},
    }
    assert upward_imports(graph) == [f"{PACKAGE}.hooks.x (hooks) imports {PACKAGE}.operators.y (operators)"]


def test_every_subpackage_says_its_job() -> None:
    for init in sorted(ROOT.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 12, f"{init} has no docstring saying its job"


def _oversized(path: Path, base: Path = ROOT.parent) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    if len(lines) > MODULE_LINES and not any(line.startswith(SIZE_REASON) for line in lines[:40]):
        found.append(f"{path.relative_to(base)}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = lines[first - 2].strip() if first >= 2 else ""
            if length > FUNCTION_LINES and not above.startswith(SIZE_REASON):
                found.append(f"{path.relative_to(base)} {node.name}")
    return found


def test_modules_and_functions_are_small_or_say_why() -> None:
    found = {item for path in sorted(ROOT.rglob("*.py")) for item in _oversized(path)}
    assert sorted(found) == [], (
        f"over {MODULE_LINES} lines (a module) or {FUNCTION_LINES} (a function), with no {SIZE_REASON!r} comment"
    )


@pytest.mark.parametrize("reason", [True, False])
def test_the_size_check_takes_a_reason(tmp_path: Path, reason: bool) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    module = tmp_path / "probe.py"
    module.write_text((f"{SIZE_REASON} a probe\n" if reason else "") + f"def f():\n{body}\n")
    assert (_oversized(module, tmp_path) == []) is reason


#: Unit test files at ``tests/unit/``'s root that test no single root module: the whole package.
WHOLE_PACKAGE_TESTS = {"test_bad_input.py", "test_import_graph.py", "test_structure.py"}
#: Folders under ``tests/unit`` that mirror no subpackage: the docs' own checks.
NOT_PACKAGE_TESTS = {"docs"}


def test_unit_tests_mirror_the_package() -> None:
    """``tests/unit/<subpackage>/test_<module>.py``: a test folder is a subpackage's, and a test at the
    root tests a root module (or the whole package)."""
    tests = ROOT.parent / "tests" / "unit"
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        if folder.parts and folder.parts[0] in NOT_PACKAGE_TESTS:
            continue
        if folder.parts and not (ROOT / folder / "__init__.py").exists():
            misplaced.append(f"{path.relative_to(tests)}: no subpackage {folder}")
        elif not folder.parts and path.name not in WHOLE_PACKAGE_TESTS:
            module = path.stem.removeprefix("test_")
            if not (ROOT / f"{module}.py").exists():
                misplaced.append(f"{path.name}: no root module {module}.py")
    assert misplaced == [], "unit tests go in tests/unit/<subpackage>/test_<module>.py"
