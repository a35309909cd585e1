"""Fill in docs/reference.md's defaults and templated fields from the operator itself.

The arguments table between ``<!-- reference:arguments:start -->`` and ``<!-- reference:arguments:end -->``
has a row per argument (or per group of related arguments): the first cell names them in
backticks, the second is their defaults, the third is hand-written. The defaults cell is rewritten
from ``TorchDistributorOperator.__init__``'s signature, and the list between
``<!-- reference:templated:start -->`` and ``<!-- reference:templated:end -->`` from its
``template_fields``. An argument without a row, or a row naming no argument, is an error that says
which. ``python docs/tools/reference_table.py`` rewrites the page;
``tests/unit/docs/test_reference_doc.py`` fails when the page is not what this renders.

Not part of the site (``exclude_docs`` in mkdocs.yml).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[1] / "reference.md"
ARGUMENTS = ("<!-- reference:arguments:start -->", "<!-- reference:arguments:end -->")
TEMPLATED = ("<!-- reference:templated:start -->", "<!-- reference:templated:end -->")
#: What the table says for an argument without a default.
REQUIRED = "required"


class ReferenceMismatch(ValueError):
    """The page's table and the operator's arguments differ: add or remove the row it names."""


def operator_arguments() -> dict[str, Any]:
    """The operator's own arguments (BaseOperator's are Airflow's) and their defaults, in order."""
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

    parameters = inspect.signature(TorchDistributorOperator.__init__).parameters.values()
    return {
        p.name: p.default
        for p in parameters
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def templated_fields() -> tuple[str, ...]:
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

    return tuple(TorchDistributorOperator.template_fields)


def default_cell(default: Any) -> str:
    """``1``, ``'spark_default'``, ``{}``; ``required`` for an argument without a default."""
    return REQUIRED if default is inspect.Parameter.empty else f"`{default!r}`"


def _between(text: str, markers: tuple[str, str]) -> tuple[str, str, str]:
    start, end = markers
    if start not in text or end not in text:
        raise ReferenceMismatch(f"docs/reference.md lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    body, tail = rest.split(end, 1)
    return head + start, body, end + tail


def render_rows(body: str, arguments: dict[str, Any]) -> str:
    """The table ``body`` with each row's defaults cell filled in from ``arguments``."""
    seen: list[str] = []
    lines = []
    for line in body.split("\n"):
        cells = line.split(" | ")
        names = re.findall(r"`(\w+)`", cells[0]) if line.startswith("| `") else []
        if names:
            if len(cells) < 3:
                raise ReferenceMismatch(
                    f"docs/reference.md's row for {', '.join(names)} needs three cells "
                    f"(argument | default | meaning): {line[:80]}"
                )
            unknown = [n for n in names if n not in arguments]
            if unknown:
                raise ReferenceMismatch(
                    f"docs/reference.md has a row for {', '.join(unknown)}, which the operator does not take"
                )
            seen += names
            cells[1] = ", ".join(default_cell(arguments[n]) for n in names)
            line = " | ".join(cells)
        lines.append(line)
    missing = [n for n in arguments if n not in seen]
    if missing:
        raise ReferenceMismatch(
            f"docs/reference.md's arguments table has no row for {', '.join(missing)}: add one"
        )
    return "\n".join(lines)


def render_reference(
    text: str, arguments: dict[str, Any] | None = None, templated: tuple[str, ...] | None = None
) -> str:
    """The page ``text`` with its defaults and templated fields from the operator (or the given ones)."""
    arguments = operator_arguments() if arguments is None else arguments
    templated = templated_fields() if templated is None else templated
    head, body, tail = _between(text, ARGUMENTS)
    text = head + render_rows(body, arguments) + tail
    head, _, tail = _between(text, TEMPLATED)
    return head + ", ".join(f"`{name}`" for name in templated) + tail


if __name__ == "__main__":
    PAGE.write_text(render_reference(PAGE.read_text()))
