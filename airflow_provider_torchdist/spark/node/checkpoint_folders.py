"""A framework's checkpoint folder (Hugging Face's ``checkpoint-<step>/``, a Lightning ``.ckpt``)
kept in the run's checkpoint store, with the same commit, retention and resume choice as
``save_checkpoint``: what the Lightning and Hugging Face checkpoint callbacks are built on.

The files are committed as they are, one object each, under one manifest; a resume fetches the
chosen checkpoint's files (each checked against the manifest) into a local folder, from which the
framework resumes as it always does. No Airflow.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.node.checkpoint_files import CHUNK
from airflow_provider_torchdist.spark.node.checkpoint_manifest import checked_file_name
from airflow_provider_torchdist.spark.node.checkpoints import commit_checkpoint, resume_choice

__all__ = ["restore_checkpoint_folder", "save_checkpoint_folder"]


def _copy_of(path: Path) -> Callable[[BinaryIO], None]:
    def write(out: BinaryIO) -> None:
        with open(path, "rb") as source:
            shutil.copyfileobj(source, out, CHUNK)

    return write


def save_checkpoint_folder(
    folder: str | os.PathLike[str],
    step: int,
    *,
    metrics: dict[str, Any] | None = None,
    exclude: Collection[str] = (),
) -> str:
    """Commit the files of the local ``folder`` (not ``exclude``) as the checkpoint of ``step``, in
    this process, then apply the task's retention; returns the checkpoint's URI.

    The folder must be flat (a framework's checkpoint folder is): a subfolder or anything but a
    regular file raises ``ValueError`` naming it, rather than a checkpoint missing part of itself.
    """
    root = Path(folder)
    files: dict[str, Any] = {}
    for entry in sorted(root.iterdir()):
        if entry.name in exclude:
            continue
        if not stat.S_ISREG(entry.lstat().st_mode):
            raise ValueError(
                f"{entry} is not a regular file: a checkpoint folder is kept file by file, flat "
                f"(exclude it with exclude=[{entry.name!r}] if the resume does not need it)"
            )
        files[checked_file_name(entry.name)] = _copy_of(entry)
    if not files:
        raise ValueError(f"{root} holds no files to keep as the checkpoint of step {step}")
    return commit_checkpoint(files, step, metrics=metrics)


def restore_checkpoint_folder(into: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """Fetch the files of the checkpoint this run resumes from into the local folder ``into``;
    returns ``(step, into)``, or None when the run starts from the beginning.

    The choice is :func:`~airflow_provider_torchdist.spark.node.checkpoints.load_latest_checkpoint`'s
    (this DAG run's newest; another run's only with ``resume_from``), and rank 0 prints it. Every
    rank calls it (each host needs the files); ranks that share a host may fetch into the same
    folder at once.
    """
    found = resume_choice()
    if found is None:
        return None
    store, manifest = found
    store.fetch(manifest, os.fspath(into))
    return manifest.step, Path(into)
