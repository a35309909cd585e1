"""Checkpoints that survive torchrun restarts and Airflow retries of the same DAG run.

The operator gives every task a directory that stays the same for all its tries (by default
``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>``, or ``checkpoint_dir=``), and every rank
finds it in ``TORCHDIST_CHECKPOINT_DIR``. Training code resumes like this::

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    start, state = load_latest_checkpoint() or (0, None)
    if state:
        model.load_state_dict(state["model"])
    for step in range(start, steps):
        ...
        if step % 10 == 0:
            save_checkpoint({"model": model.state_dict()}, step + 1)   # rank 0 writes; others no-op

On a multi-host cluster the directory must be on storage every host sees (NFS and the like).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

CHECKPOINT_ENV = "TORCHDIST_CHECKPOINT_DIR"
_NAME = re.compile(r"^step-(\d{9})\.pt$")


def checkpoint_dir() -> Path | None:
    """This task's checkpoint directory, or None when the run has none.

    ``checkpoint_dir="file:///shared/ckpt"`` names the local path ``/shared/ckpt``, as it does for
    the hook's check before the run (``preflight.check_checkpoint_dir``).
    """
    value = os.environ.get(CHECKPOINT_ENV)
    if value and value[:7].lower() == "file://":
        value = value[7:]
    return Path(value) if value else None


def save_checkpoint(state: Any, step: int, *, keep: int = 2, all_ranks: bool = False) -> Path | None:
    """Write ``state`` as the checkpoint of ``step`` (global rank 0 only, unless ``all_ranks``).

    Written to a temporary name and renamed, so a rank killed mid-write never leaves a torn
    checkpoint that a restart would load. Keeps the newest ``keep`` checkpoints.
    """
    import torch

    directory = checkpoint_dir()
    if directory is None:
        raise RuntimeError(f"no checkpoint directory: {CHECKPOINT_ENV} is not set (set checkpoint_dir=)")
    if int(os.environ.get("RANK", "0")) != 0 and not all_ranks:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:09d}.pt"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, final)
    for old in sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_latest_checkpoint(map_location: Any = "cpu") -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint, or None when there is none yet."""
    import torch

    directory = checkpoint_dir()
    if directory is None or not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    if not found:
        return None
    latest = found[-1]
    return int(_NAME.match(latest.name)[1]), torch.load(latest, map_location=map_location, weights_only=False)
