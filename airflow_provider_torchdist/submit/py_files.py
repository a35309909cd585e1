"""``py_files``: the user's Python code shipped with the run (spark-submit's ``--py-files``).

Each entry is a ``.py``, ``.zip`` or ``.egg`` file, sent as it is, or a directory, zipped into the
run's staging directory first: a directory holding ``__init__.py`` as that package (``mypkg/`` is
importable as ``mypkg``), any other directory as a source root (its contents at the zip's top).
Spark puts them on the driver's and the executors' ``sys.path``; torchrun's ranks inherit it.

Module mode (``train_object="-m mypkg.train"``) on the embedded master or in local mode runs where
this worker's Python runs, so a module importable neither here nor from ``py_files`` fails before
spark-submit (:func:`check_module_importable`).
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from importlib.machinery import PathFinder
from pathlib import Path

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.submit.staging import SPARK_ZIP, STAGED_FILE_NAMES

SUFFIXES = (".py", ".zip", ".egg")


def stage_py_files(entries: list[str], staging_dir: Path) -> list[str]:
    """What goes to ``--py-files`` for ``entries``: files as they are, directories zipped into
    ``staging_dir``. Raises :class:`InvalidTrainingConfig` for a missing or unsuitable entry."""
    staged: list[str] = []
    for n, entry in enumerate(entries):
        path = Path(entry).expanduser()
        if not path.is_absolute():
            raise InvalidTrainingConfig(
                f"py_files entry {entry!r} is not an absolute path: it would depend on the worker's "
                "current directory. Give the absolute path of the file or directory."
            )
        if path.is_dir():
            staged.append(str(zip_directory(path, staging_dir / f"py-files-{n}-{path.name}.zip")))
        elif path.is_file() and path.suffix in SUFFIXES:
            staged.append(str(path.resolve()))
        else:
            what = "is not a .py, .zip or .egg file" if path.exists() else "does not exist on this worker"
            raise InvalidTrainingConfig(
                f"py_files entry {entry!r} {what}: give .py, .zip or .egg files, or directories (a "
                "package directory is shipped as that package, any other directory as a source root)."
            )
    names = [Path(p).name for p in staged]
    for entry, name in zip(entries, names, strict=True):
        why = (
            "contains ',' or '#', which spark-submit's --py-files splits on or renames by"
            if "," in name or "#" in name
            else "is the name of one of this provider's own staged files"
            if name in STAGED_FILE_NAMES or name == SPARK_ZIP
            else "is the name of another entry: Spark keeps one file per name"
            if names.count(name) > 1
            else None
        )
        if why:
            raise InvalidTrainingConfig(
                f"py_files entry {entry!r} ships as {name!r}, which {why}. Rename it."
            )
    return staged


def zip_directory(src: Path, dest: Path) -> Path:
    """``src`` zipped to ``dest`` (0600): as the package ``src.name`` when it holds
    ``__init__.py``, else its contents at the top. Compiled files, caches and dot-directories
    (``.git``, ``.venv``) are left out; a symbolic link that leads out of ``src`` is refused."""
    real = src.resolve()
    if dest.resolve().is_relative_to(real):
        raise InvalidTrainingConfig(
            f"py_files directory {str(src)!r} holds the run's staging directory ({dest.parent}): zipping "
            "it would zip its own zip. Ship the package directory itself, not a directory above the "
            "temp dir, or set staging_dir elsewhere."
        )
    prefix = src.name if (src / "__init__.py").is_file() else ""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as zf:
            for top, dirs, files in os.walk(src, followlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for name in sorted(files):
                    path = Path(top, name)
                    if name.endswith((".pyc", ".pyo")):
                        continue
                    if path.is_symlink() and not path.resolve().is_relative_to(real):
                        raise InvalidTrainingConfig(
                            f"py_files directory {str(src)!r} holds a symbolic link that leads out of it: {path}. "
                            "Copy what it points to into the directory, or remove the link."
                        )
                    zf.write(path, Path(prefix, path.relative_to(src)).as_posix())
    except BaseException:
        dest.unlink(missing_ok=True)  # no half-written zip left behind
        raise
    return dest


def check_module_importable(module: str, py_files: list[str]) -> None:
    """Fail before spark-submit when ``module`` can be found neither on this Python's path nor in
    ``py_files`` (found by path only: nothing of the user's is imported here)."""
    top, *rest = module.split(".")
    # A .py entry is a module in its directory; a zip or egg is searched as a path entry itself.
    search = [str(Path(p).parent) if p.endswith(".py") else p for p in py_files]
    # The top package: in py_files, or through every finder of this Python (editable installs
    # included); find_spec of a top-level name imports nothing.
    try:
        spec = PathFinder.find_spec(top, search) or importlib.util.find_spec(top)
    except (ImportError, ValueError):  # "__main__" has no spec, say
        spec = None
    for part in rest:  # submodules by path, so that no package __init__ of the user's runs here
        if spec is None:
            break
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations or []))
    if spec is None:
        raise InvalidTrainingConfig(
            f"train_object module {module!r} cannot be found: not installed in this Python, and not in "
            f"py_files={py_files!r}. Ship its package directory with py_files=['/path/to/{module.split('.')[0]}'] "
            "(or a .zip / .egg of it), or install it where the ranks run."
        )
