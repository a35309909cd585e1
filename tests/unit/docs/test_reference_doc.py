"""docs/reference.md's defaults and templated fields are the operator's: a changed default, a new
argument or a new template field fails here until ``python docs/tools/reference_table.py`` is run
(and, for a new argument, a row is written)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "reference.md"


def reference_table() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "reference_table", ROOT / "docs" / "tools" / "reference_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_what_the_operator_says() -> None:
    text = PAGE.read_text()
    assert reference_table().render_reference(text) == text, (
        "docs/reference.md's defaults or templated fields are stale: run `python docs/tools/reference_table.py`"
    )


def test_every_argument_and_template_field_is_on_the_page_with_its_default() -> None:
    """Read back from the page itself, independently of the generator."""
    text = PAGE.read_text()
    rows = re.findall(r"^\| (`[^|]*) \| ([^|]*) \| ", text, flags=re.M)
    on_page: dict[str, str] = {}
    for names, defaults in rows:
        on_page.update(zip(re.findall(r"`(\w+)`", names), defaults.split(", "), strict=True))
    parameters = inspect.signature(TorchDistributorOperator.__init__).parameters
    expected = {
        name: "required" if p.default is inspect.Parameter.empty else f"`{p.default!r}`"
        for name, p in parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    assert on_page == expected
    assert on_page["local_mode"] == "`False`" and "PySpark's `TorchDistributor` defaults to `True`" in text
    listed = re.search(r"<!-- reference:templated:start -->(.*?)<!-- reference:templated:end -->", text, re.S)
    assert listed is not None
    assert re.findall(r"`(\w+)`", listed[1]) == list(TorchDistributorOperator.template_fields)


def test_a_stale_default_a_missing_row_and_an_unknown_row_are_found() -> None:
    tool = reference_table()
    page = (
        f"{tool.ARGUMENTS[0]}\n| argument | default | meaning |\n|---|---|---|\n"
        "| `num_processes` | `2` | ranks |\n| `local_mode` | – | where |\n"
        f"{tool.ARGUMENTS[1]}\nTemplated: {tool.TEMPLATED[0]}`conf`{tool.TEMPLATED[1]}.\n"
    )
    arguments = {"num_processes": 1, "local_mode": False}
    rendered = tool.render_reference(page, arguments, ("num_processes", "local_mode"))
    assert (
        "| `num_processes` | `1` | ranks |" in rendered and "| `local_mode` | `False` | where |" in rendered
    )
    assert f"{tool.TEMPLATED[0]}`num_processes`, `local_mode`{tool.TEMPLATED[1]}" in rendered
    with pytest.raises(tool.ReferenceMismatch, match="no row for use_gpu: add one"):
        tool.render_reference(page, {**arguments, "use_gpu": False}, ())
    with pytest.raises(
        tool.ReferenceMismatch, match="a row for local_mode, which the operator does not take"
    ):
        tool.render_reference(page, {"num_processes": 1}, ())
    with pytest.raises(tool.ReferenceMismatch, match="needs three cells"):
        tool.render_reference(page.replace("| `2` | ranks |", "| ranks |"), arguments, ())
