"""A script's or module's ``args``: its command line, so only values a command line can carry.

A callable takes any value in ``args``; a script gets each one as ``str(value)``. ``str`` of a
dict, a list, None or an object (``"{'lr': 0.1}"``, ``"None"``, ``"<Model object at 0x...>"``) is
never what the script meant to read, so those are refused (when the DAG is parsed, for literal
``args``; again before staging, after rendering) instead of reaching its ``argparse`` as text.

Example::

    script_argv(["--lr", 0.001, Path("/data")])  # ['--lr', '0.001', '/data']
    script_argv([{"lr": 0.1}])  # InvalidTrainingConfig: args[0] is a dict ...
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig

#: What a script's argument may be: each is passed as ``str(value)`` (a path as ``os.fspath``).
ARGV_TYPES = (str, int, float, os.PathLike)


def script_argv(args: Sequence[Any] | None, *, lazy: tuple[type, ...] = ()) -> list[str]:
    """``args`` as the script's command-line arguments; raises for a value no command line carries.

    ``lazy``: types of values that are not known yet (an upstream ``XComArg`` at parse time): they
    are left as they are, and checked once resolved.
    """
    argv: list[Any] = []
    for i, value in enumerate(args or ()):
        if lazy and isinstance(value, lazy):
            argv.append(value)
            continue
        if not isinstance(value, ARGV_TYPES):
            what = "None" if value is None else f"a {type(value).__name__}"
            raise InvalidTrainingConfig(
                f"args[{i}] is {what} ({value!r}), but a script's args are its command-line arguments, "
                "each passed as text: give strings, numbers or paths (args=['--lr', '0.001']). Pass "
                "structured settings as a JSON string (json.dumps) and parse it in the script, or "
                "train a callable, which takes any value."
            )
        argv.append(os.fspath(value) if isinstance(value, os.PathLike) else str(value))
    return argv
