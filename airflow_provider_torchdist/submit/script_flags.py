"""A script's or module's ``kwargs`` as command-line flags: ``{"epochs": 3}`` gives ``--epochs 3``.

Example::

    script_flags({"epochs": 3, "lr": 0.1, "amp": True, "resume": False, "tag": None})
    # ['--epochs', '3', '--lr', '0.1', '--amp']

The rules, chosen so that ``argparse`` (and click, typer, absl) read back what was meant:

- a key is the flag as written, without the dashes: ``{"batch-size": 32}`` gives
  ``--batch-size 32`` and ``{"batch_size": 32}`` gives ``--batch_size 32`` (nothing is renamed);
- ``True`` gives the bare flag (``store_true``); ``False`` and ``None`` leave the flag out;
- a string, number or path gives the flag and its value as two arguments, except a string that
  starts with ``-``, which is passed as ``--key=value`` so it is not read as the next flag;
- lists, tuples, sets and dicts are refused: whether a list is ``--x 1 2`` (``nargs="+"``) or
  ``--x 1 --x 2`` (``action="append"``) depends on the script's parser, so write it in ``args``.

The flags follow ``args`` on the command line. Checked when the DAG is parsed (for literal
``kwargs``) and again before staging, after rendering.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig

#: A flag name: a letter, then letters, digits, ``-`` or ``_`` (``lr``, ``batch-size``, ``max_steps``).
FLAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not FLAG_NAME.fullmatch(key):
        raise InvalidTrainingConfig(
            f"kwargs key {key!r} cannot be a command-line flag of a script: a key must be a string that "
            "starts with a letter and holds only letters, digits, '-' and '_' (written without the "
            "dashes: {'epochs': 3} gives --epochs 3). Put other arguments in args as you want them "
            "on the command line."
        )
    return key


def _flag_value(key: str, value: Any) -> list[str]:
    """The arguments one checked key gives for ``value``."""
    flag = f"--{key}"
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidTrainingConfig(
            f"kwargs {key!r}={value!r} is not a finite number: a script's flag would read {value!r} "
            "as text. Give a finite number."
        )
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, (int, float)):
        return [flag, str(value)]
    if isinstance(value, str):
        # "--key -x" would read -x as the next option: "--key=-x" cannot be misread.
        return [f"{flag}={value}"] if value.startswith("-") else [flag, value]
    if isinstance(value, (list, tuple, set, frozenset)):
        raise InvalidTrainingConfig(
            f"kwargs {key!r} is a {type(value).__name__}, which has no one command-line form: "
            f"--{key} 1 2 (nargs='+') and --{key} 1 --{key} 2 (action='append') mean different things "
            f"to a script's parser. Write it in args the way the script reads it, e.g. "
            f"args=['--{key}', '1', '2']."
        )
    raise InvalidTrainingConfig(
        f"kwargs {key!r} is a {type(value).__name__} ({value!r}): a script's flag takes a string, a "
        "number, a path, True (the bare flag), or False or None (left out). Pass structured settings "
        "as a JSON string and parse it in the script, or train a callable, which takes any value."
    )


def script_flags(kwargs: Mapping[Any, Any] | None) -> list[str]:
    """The command-line flags ``kwargs`` give a script or module (see the module docstring);
    raises :class:`InvalidTrainingConfig` naming the key that has no unambiguous flag."""
    flags: list[str] = []
    for key, value in (kwargs or {}).items():
        flags += _flag_value(_check_key(key), value)
    return flags
