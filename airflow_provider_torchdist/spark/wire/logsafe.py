"""Text from ranks made safe for the task log: no forged lines, no terminal escapes.

Standard library only: this runs on the Spark side too, which imports no Airflow.
"""

from __future__ import annotations

import re

# What can end a line somewhere (a terminal, a log viewer, Python's ``str.splitlines``), drive a
# terminal, or reorder how a line is displayed: C0 controls except tab, DEL, C1 controls (NEL
# among them), the Unicode line and paragraph separators, the bidirectional controls, and lone
# surrogates (which a UTF-8 stream cannot even encode). Everything else, printable Unicode
# included, passes unchanged.
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def escape_controls(text: str) -> str:
    r"""``text`` as one visible line: ``"a\x1b[2Jb\nc"`` becomes ``a\x1b[2Jb\nc`` with the backslashes
    literal. Backslashes themselves are left alone, so escaping twice changes nothing more and
    Windows paths stay readable."""
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(_escape, text)
