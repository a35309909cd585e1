"""Java ``.properties`` files, as spark-submit's ``--properties-file`` reads them.

The hook hands spark-submit its Spark settings in such a file (0600, in the run's private staging
directory) instead of ``--conf key=value`` pairs, which anyone on the machine could read in the
process list. spark-submit takes one ``--properties-file`` and then skips ``spark-defaults.conf``,
so the file merges, lowest precedence first: ``spark-defaults.conf`` (only when the user gave no
``properties_file``, as spark-submit does), the user's ``properties_file``, then every ``--conf``
pair the command would have carried.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from airflow_provider_torchdist.spark.wire.private_files import write_private_text

_WHITESPACE = " \t\f"
_UNESCAPE = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
# What java.util.Properties.store escapes with a backslash in keys (a key's spaces too) and values.
_SPECIAL = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}
_PUNCTUATION = "=:#!"


def _logical_lines(text: str) -> list[str]:
    """Natural lines joined where one ends in an odd number of backslashes, comments and blank
    lines dropped, each continuation's leading whitespace stripped (``Properties.load``)."""
    lines: list[str] = []
    current: str | None = None
    for raw in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        line = raw.lstrip(_WHITESPACE)
        if current is None:
            if not line or line[0] in "#!":
                continue
            current = ""
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            current += line[:-1]
            continue
        lines.append(current + line)
        current = None
    if current is not None:  # the file ended on a continuation
        lines.append(current)
    return lines


def _unescape(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        i += 1
        if ch != "\\" or i == len(text):
            if ch != "\\":
                out.append(ch)
            continue
        ch = text[i]
        i += 1
        if ch == "u":
            digits = text[i : i + 4]
            try:
                if len(digits) != 4:
                    raise ValueError
                out.append(chr(int(digits, 16)))
            except ValueError:
                raise ValueError(f"malformed \\uxxxx escape: \\u{digits}") from None
            i += 4
        else:
            out.append(_UNESCAPE.get(ch, ch))
    # Java strings are UTF-16: an escaped surrogate pair is one character.
    joined = "".join(out)
    return joined.encode("utf-16-be", "surrogatepass").decode("utf-16-be", "surrogatepass")


def _split(line: str) -> tuple[str, str]:
    """A logical line's key and value: the key ends at the first unescaped ``=``, ``:`` or
    whitespace; whitespace, then one ``=`` or ``:``, then whitespace separate it from the value."""
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\":
            i += 2
            continue
        if ch in "=:" or ch in _WHITESPACE:
            break
        i += 1
    key, rest = line[:i], line[i:]
    rest = rest.lstrip(_WHITESPACE)
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(_WHITESPACE)
    return _unescape(key), _unescape(rest)


def parse_properties(text: str) -> dict[str, str]:
    """``text`` read as ``java.util.Properties.load`` reads it; a key given twice keeps its last value.

    Raises ``ValueError`` on a malformed ``\\uxxxx`` escape, as Java does.
    """
    props: dict[str, str] = {}
    for line in _logical_lines(text):
        key, value = _split(line)
        props[key] = value
    return props


def read_properties(path: str | os.PathLike[str]) -> dict[str, str]:
    """A properties file, decoded as UTF-8 like Spark does (bad bytes become U+FFFD)."""
    return parse_properties(Path(path).read_bytes().decode("utf-8", errors="replace"))


def _escape(text: str, is_key: bool) -> str:
    out: list[str] = []
    for i, unit in enumerate(_utf16_units(text)):
        ch = chr(unit)
        if ch == " ":
            out.append("\\ " if is_key or i == 0 else " ")
        elif ch in _SPECIAL:
            out.append(_SPECIAL[ch])
        elif ch in _PUNCTUATION:
            out.append("\\" + ch)
        elif unit < 0x20 or unit > 0x7E:
            out.append(f"\\u{unit:04X}")
        else:
            out.append(ch)
    return "".join(out)


def _utf16_units(text: str) -> list[int]:
    data = text.encode("utf-16-be", "surrogatepass")
    return [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]


def format_properties(props: Mapping[str, str]) -> str:
    """``props`` as a properties file that Java reads back exactly: ASCII only, with keys' and
    values' backslashes, leading spaces (every space in a key), ``=``, ``:``, ``#``, ``!``, line
    breaks and non-ASCII characters escaped as ``Properties.store`` does."""
    return "".join(f"{_escape(k, True)}={_escape(v, False)}\n" for k, v in props.items())


def write_private_properties(path: str | os.PathLike[str], props: Mapping[str, str]) -> None:
    """Write ``props`` to ``path`` in a file only its owner can read (:func:`write_private_text`)."""
    write_private_text(path, format_properties(props), encoding="ascii")


def spark_defaults_file(environ: Mapping[str, str], spark_home: str | None) -> Path | None:
    """``spark-defaults.conf`` where spark-submit looks for it: ``$SPARK_CONF_DIR``, else
    ``$SPARK_HOME/conf``; None when neither is known or the file does not exist."""
    conf_dir = environ.get("SPARK_CONF_DIR") or (os.path.join(spark_home, "conf") if spark_home else None)
    if not conf_dir:
        return None
    path = Path(conf_dir) / "spark-defaults.conf"
    return path if path.is_file() else None
