"""The pickled payload: the training callable with its arguments, cloudpickled for the ranks.

User modules travel by value (a DAG file's module name does not exist on the executors); what
cannot travel (locks, sockets, clients, open files) is refused, naming the piece that failed:
``closure variable 'lock' of train``. An open file is refused too, although cloudpickle could
ship a read-mode one as a silent copy of its contents; ``sys.stdout`` and ``sys.stderr`` are no
copy and travel as the rank's own streams.
"""

from __future__ import annotations

import io
import os
import sys
import sysconfig
from collections import ChainMap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, ModuleType
from typing import Any

import cloudpickle

from airflow_provider_torchdist.errors import PayloadNotPicklable

_FILE_TYPES = (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO)


def _library_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {sys.base_prefix, sys.prefix} - {""}
    return sorted({os.path.realpath(r) for r in roots})


def modules_to_pickle_by_value() -> list[ModuleType]:
    """Loaded modules that Spark executors could not import by name.

    Airflow imports DAG files under generated module names, and the DAG folder is not on the
    executors' path, so cloudpickle's default (pickle functions from importable modules by
    reference) would fail there. Any module whose file lies outside the standard library and
    site-packages is user code: it travels by value. This provider's own code travels as
    ``--py-files`` instead.
    """
    roots = _library_roots()
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name == "__main__" or name.split(".")[0] == "airflow_provider_torchdist":
            continue
        if getattr(module, "__name__", None) != name:  # an alias: cloudpickle registers by __name__
            continue
        real = os.path.realpath(file)
        if not any(real.startswith(root + os.sep) for root in roots):
            found.append(module)
    return found


@contextmanager
def _by_value(modules: list[ModuleType]) -> Iterator[None]:
    already = cloudpickle.list_registry_pickle_by_value()
    added = [m for m in modules if m.__name__ not in already]
    for module in added:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in added:
            cloudpickle.unregister_pickle_by_value(module)


#: cloudpickle's reduction of a code object, and the file name it puts in place of the real one.
_CODE_REDUCE = cloudpickle.CloudPickler.dispatch_table[CodeType]
_DYNAMIC_FILE = "<dynamic-code>"


def _code_with_its_file(code: CodeType) -> Any:
    """cloudpickle's reduction of ``code``, keeping its ``co_filename``.

    cloudpickle writes ``<dynamic-code>`` there (for payloads that do not depend on where a function
    was defined), so a rank's traceback through a function from the DAG file read
    ``File "<dynamic-code>", line 12``. Kept, it names the DAG file and line; the line numbers
    travel with the code anyway."""
    rebuild, args = _CODE_REDUCE(code)
    if _DYNAMIC_FILE in args:
        at = args.index(_DYNAMIC_FILE)
        args = (*args[:at], code.co_filename, *args[at + 1 :])
    return rebuild, args


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, less its reduction of open files (pickle's documented ``dispatch_table``):
    a read-mode file would arrive as a silent copy of its contents; it is refused like any handle.
    Code objects keep their file name (:func:`_code_with_its_file`)."""

    dispatch_table = ChainMap(
        {CodeType: _code_with_its_file},
        dict.fromkeys(_FILE_TYPES, lambda f: _refuse_file(f)),
        cloudpickle.CloudPickler.dispatch_table,
    )


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def _refuse_file(f: Any) -> Any:
    # The standard streams are no copy: as cloudpickle does, they become the rank's own (whose
    # lines reach the task log).
    for name in ("stdout", "stderr"):
        if f is getattr(sys, name) or f is getattr(sys, f"__{name}__"):
            return getattr, (sys, name)
    raise TypeError(f"an open file ({getattr(f, 'name', '?')!r}) cannot travel to the ranks; open it there")


def _culprit(label: str, obj: Any, depth: int = 0) -> str | None:
    """Name the innermost piece of ``obj`` that cannot be pickled, e.g. ``closure variable 'lock'``."""
    try:
        _dumps(obj)
        return None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    code = getattr(obj, "__code__", None)
    if code is not None and depth < 3:
        parts: list[tuple[str, Any]] = []
        for name, cell in zip(code.co_freevars, getattr(obj, "__closure__", None) or (), strict=False):
            try:
                parts.append((f"closure variable {name!r} of {obj.__qualname__}", cell.cell_contents))
            except ValueError:  # an empty cell
                continue
        globals_ = getattr(obj, "__globals__", {})
        parts += [
            (f"global {n!r} used by {obj.__qualname__}", globals_[n]) for n in code.co_names if n in globals_
        ]
        parts += [
            (f"default argument of {obj.__qualname__}", d) for d in getattr(obj, "__defaults__", None) or ()
        ]
        for sub_label, sub in parts:
            found = _culprit(sub_label, sub, depth + 1)
            if found:
                return found
    return f"{label} ({type(obj).__name__}): {error}"


def pickle_payload(
    fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], *, label: str = "train_object"
) -> bytes:
    """cloudpickle the callable with its arguments, user modules by value; name what fails
    (``label``: the setting the callable came from)."""
    with _by_value(modules_to_pickle_by_value()):
        try:
            return _dumps({"fn": fn, "args": tuple(args), "kwargs": kwargs})
        except Exception:
            pieces = [(f"{label} " + getattr(fn, "__qualname__", repr(fn)), fn)]
            pieces += [(f"args[{i}]", a) for i, a in enumerate(args)]
            pieces += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
            culprit = next(filter(None, (_culprit(label, obj) for label, obj in pieces)), None)
            raise PayloadNotPicklable(
                f"Cannot pickle the training payload: {culprit or 'unknown object'}. The callable, what it "
                "refers to (globals, closure, defaults) and its args/kwargs are cloudpickled to ship them "
                "to Spark; create locks, open files, sockets and clients inside the function instead."
            ) from None
