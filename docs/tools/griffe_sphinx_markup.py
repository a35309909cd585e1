"""A griffe extension for the API page: the docstrings' Sphinx markup, as Markdown.

The package's docstrings are written for ``help()`` and Sphinx: roles such as
``:func:`~airflow_provider_torchdist.load_output``` and literal blocks opened by ``Example::``.
mkdocstrings' Sphinx parser reads their ``:param:`` fields but renders the rest as Markdown, where
those print as they are. This rewrites each docstring as the API page is built (the source keeps
its Sphinx markup): a role becomes a code span of the name (its last part with ``~``, as Sphinx
shows it), and a ``::`` literal block a fenced Python block after a single colon.

mkdocs.yml names this file in mkdocstrings' ``extensions``; it is not part of the site.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

#: ``:func:`name```, ``:class:`~pkg.Name```, ``:meth:`Hook.run```, ...
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match[2].strip()
    return f"`{target.rsplit('.', 1)[-1] if match[1] else target}`"


def literal_blocks(text: str) -> str:
    """``Example::`` and its indented block as ``Example:`` and a fenced Python block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        lead = line.rstrip()[:-2].rstrip()
        if lead:
            out.append(lead + ":")
        indent = len(line) - len(line.lstrip())
        j = i + 1
        block: list[str] = []
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():  # trailing blank lines belong after the fence
            block.pop()
            j -= 1
        out += ["", "```python", *textwrap.dedent("\n".join(block)).strip("\n").split("\n"), "```"]
        i = j
    return "\n".join(out)


def to_markdown(text: str) -> str:
    """A docstring's Sphinx roles and literal blocks, as Markdown."""
    return literal_blocks(ROLE.sub(_role, text))


class SphinxMarkup(griffe.Extension):
    """Rewrite every docstring the API page renders (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
