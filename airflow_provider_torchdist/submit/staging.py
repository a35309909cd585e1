"""Packaging a run: the private staging directory, the pickled payload or script, the job spec.

The directory is created 0700 and every file in it 0600, so other users on the Airflow worker
cannot read the training code or swap it. It is removed after the run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.wire.jobspec import (
    DATA_FILE,
    OUTCOME_FILE,
    OUTPUT_FILE,
    PAYLOAD_FILE,
    SPEC_FILE,
    JobSpec,
)
from airflow_provider_torchdist.spark.wire.output_store import MANIFEST_SUFFIX
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.payload import (
    modules_to_pickle_by_value as modules_to_pickle_by_value,  # re-exported
)
from airflow_provider_torchdist.submit.payload import pickle_payload
from airflow_provider_torchdist.submit.script_args import script_argv
from airflow_provider_torchdist.submit.script_flags import script_flags
from airflow_provider_torchdist.submit.train_module import module_name

#: The package's own folder (this module is in its submit/ subpackage).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
SPARK_ZIP = "torchdist_spark.zip"
DRIVER_SCRIPT = "torchdist_driver.py"
_DRIVER_SOURCE = (
    "import sys\n"
    "from airflow_provider_torchdist.spark.node.pyspark_path import prefer_installed_pyspark\n"
    "prefer_installed_pyspark()\n"
    "from airflow_provider_torchdist.spark.app import run_and_exit\n"
    "run_and_exit(sys.argv)\n"
)
#: The names this provider writes into a staging directory (and ships to the executors' working
#: directories): a script of one of these names would overwrite them, or they it.
STAGED_FILE_NAMES = frozenset(
    {
        SPEC_FILE,
        PAYLOAD_FILE,
        OUTPUT_FILE,
        OUTPUT_FILE + MANIFEST_SUFFIX,
        OUTCOME_FILE,
        SPARK_ZIP,
        DRIVER_SCRIPT,
    }
)
#: Characters Spark reads in a ``--files`` entry: ``,`` separates entries and ``#`` renames the file.
_SPARK_FILES_SPECIAL = (",", "#")


@dataclass
class StagedRun:
    """A staged run: what spark-submit needs (files, py-files, driver, spec) and where output lands."""

    dir: Path
    spec: JobSpec
    spec_path: Path
    driver_path: Path
    files: list[str]
    py_files: str

    @property
    def output_path(self) -> Path:
        return self.dir / OUTPUT_FILE

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _spark_files_special(text: str) -> str:
    """The characters of ``text`` that spark-submit's ``--files`` would not take literally."""
    return " and ".join(repr(c) for c in _SPARK_FILES_SPECIAL if c in text)


def check_script_name(path: str) -> None:
    """A script path must name a ``.py`` file that can travel with ``--files`` under its own name.

    Checked when the DAG is parsed (operator) and again before staging (hook): a name with ``,``
    or ``#`` would be split or renamed by Spark, and one of :data:`STAGED_FILE_NAMES` would collide
    with the provider's own files.
    """
    name = Path(path).name
    if not name.endswith(".py"):
        raise InvalidTrainingConfig(
            f"train_object script {path!r} is not a .py file: give the path of a Python training "
            "script whose name ends in .py (it runs like torchrun script.py), or pass a callable."
        )
    special = _spark_files_special(name)
    if special:
        raise InvalidTrainingConfig(
            f"train_object script name {name!r} contains {special}: spark-submit's --files splits its "
            "list on ',' and Spark reads '#' as 'rename to', so the script would not arrive under its "
            "name. Rename the file without those characters."
        )
    if name.casefold() in {n.casefold() for n in STAGED_FILE_NAMES}:
        raise InvalidTrainingConfig(
            f"train_object script name {name!r} is the name of one of this provider's own staged files "
            f"({', '.join(sorted(STAGED_FILE_NAMES))}): it would collide with it in the staging directory "
            "and in the executors' working directories. Rename the script."
        )


def check_staging_dir(base_dir: str | None) -> None:
    """The staging directory's path is part of every ``--files`` and ``--py-files`` entry."""
    path = os.path.abspath(base_dir or tempfile.gettempdir())
    special = _spark_files_special(path)
    if special:
        raise InvalidTrainingConfig(
            f"staging_dir {path!r} contains {special}: spark-submit's --files and --py-files split their "
            "lists on ',' and Spark reads '#' as 'rename to', so the staged files would not arrive. "
            "Set staging_dir (or TMPDIR) to a directory without those characters."
        )


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _spark_zip(dest: Path) -> None:
    """Zip the Spark side of this package for ``--py-files``: the cluster installs nothing.

    ``callbacks/`` goes too: the framework callbacks run inside the ranks, in the training code.
    """
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(PACKAGE_DIR / "__init__.py", "airflow_provider_torchdist/__init__.py")
        zf.write(PACKAGE_DIR / "spec.py", "airflow_provider_torchdist/spec.py")  # JobSpec's base
        for package in ("spark", "callbacks"):
            for path in sorted((PACKAGE_DIR / package).rglob("*.py")):
                zf.write(path, f"airflow_provider_torchdist/{path.relative_to(PACKAGE_DIR).as_posix()}")
    os.chmod(dest, 0o600)


def packaged_work(
    train_object: Callable[..., Any] | str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[str, str, bytes | None, list[str]]:
    """The work as the job spec names it: its ``kind``, its ``entry`` (a file in the staging
    directory, or a module's name), the entry's bytes (None for a module: nothing is shipped) and a
    script's or module's command-line arguments: ``args``, then ``kwargs`` as flags
    (:func:`~airflow_provider_torchdist.submit.script_flags.script_flags`). Raises for a missing or
    misnamed script, or keyword arguments that have no unambiguous flag."""
    if callable(train_object):
        kind, entry, data = "callable", PAYLOAD_FILE, pickle_payload(train_object, args, kwargs)
        script_args: list[str] = []
    elif (module := module_name(train_object)) is not None:
        kind, entry, data = "module", module, None
        script_args = script_argv(args) + script_flags(kwargs)
    else:
        script = Path(train_object).expanduser()
        check_script_name(str(train_object))
        if not script.is_file():
            raise InvalidTrainingConfig(
                f"train_object script {str(train_object)!r} does not exist on this Airflow worker "
                f"(resolved to {script.resolve()}). Give the path of a .py file that the worker can read."
            )
        flags = script_flags(kwargs)  # before reading the file: a bad key fails first and cheaply
        kind, entry, data = "script", script.name, script.read_bytes()
        script_args = script_argv(args) + flags
    return kind, entry, data, script_args


def stage_run(
    train_object: Callable[..., Any] | str,
    args: list[Any],
    kwargs: dict[str, Any],
    *,
    base_dir: str | None = None,
    training: TrainingSpec | None = None,
    **run_fields: Any,
) -> StagedRun:
    """Check and pickle the work, then write everything a run needs into a fresh private directory.

    The job spec is ``training``'s cluster settings plus the run's identity; ``run_fields`` adds
    run-time values (the effective ``slot_timeout``) or, for tests, settings.

    Raises before anything is written when a script is missing or misnamed, the staging directory's
    path cannot travel with ``--files``, or the payload cannot be pickled.
    """
    check_staging_dir(base_dir)
    kind, entry, data, script_args = packaged_work(train_object, args, kwargs)
    data_fn = training.train_data if training is not None and callable(training.train_data) else None
    data_source = None if data_fn is None else pickle_payload(data_fn, [], {}, label="train_data")
    staging = Path(tempfile.mkdtemp(prefix="torchdist-", dir=base_dir))
    try:
        if data is not None:  # a module is imported on the ranks, nothing to ship
            _write_private(staging / entry, data)
        if data_source is not None:  # for the driver, which runs on this machine: not shipped
            _write_private(staging / DATA_FILE, data_source)
            run_fields["data_file"] = DATA_FILE
        spec = JobSpec.for_run(
            training or TrainingSpec(),
            kind=kind,
            entry=entry,
            script_args=script_args,
            run_id=staging.name.removeprefix("torchdist-") + secrets.token_hex(4),
            token=secrets.token_urlsafe(32),
            **run_fields,
        )
        spec_path = spec.write(staging)
        os.chmod(spec_path, 0o600)
        _spark_zip(staging / SPARK_ZIP)
        driver = staging / DRIVER_SCRIPT
        _write_private(driver, _DRIVER_SOURCE.encode())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return StagedRun(
        dir=staging,
        spec=spec,
        spec_path=spec_path,
        driver_path=driver,
        files=[] if data is None else [str(staging / entry)],
        py_files=str(staging / SPARK_ZIP),
    )
