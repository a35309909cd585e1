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

Checkpoints are loaded with ``torch.load(..., weights_only=True)``: tensors, numbers, strings and
plain containers (a model's or an optimizer's ``state_dict``), never arbitrary pickled objects.
The directory is writable from every executor, so a full unpickle would let any one of them run
code in rank 0 on the next restart by planting a newer checkpoint. Classes of your own can be
allowed by name with ``torch.serialization.add_safe_globals([MyConfig])`` at the top of the
training function (it runs again on every restart, before the load); ``weights_only=False`` opts
back into full pickle (see :func:`load_latest_checkpoint`).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

CHECKPOINT_ENV = "TORCHDIST_CHECKPOINT_DIR"
_NAME = re.compile(r"^step-(\d{9})\.pt$")
_OPT_IN = (
    "If the objects are yours, allow their classes by name with "
    "torch.serialization.add_safe_globals([...]) at the top of the training function, or save "
    "plain data (tensors, numbers, strings, lists, dicts: a state_dict()); only if every process "
    "that can write the checkpoint directory is trusted, pass weights_only=False (to "
    "save_checkpoint and load_latest_checkpoint), which runs whatever code the file holds."
)


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint holds objects that a ``weights_only`` load does not create.

    Raised by :func:`load_latest_checkpoint` for a file it refuses to unpickle, and by
    :func:`save_checkpoint` for a state that such a load would refuse (so the run fails at its
    first checkpoint, not at the restart that needs it). The message names the file and the
    classes or functions it holds, and says how to opt in.
    """


def _unsafe_globals(path: Path) -> list[str]:
    """The classes and functions in ``path``'s pickle that a ``weights_only`` load refuses.

    Read statically, nothing unpickled; empty for a file that is not torch.save's zip format (a
    legacy pickle or garbage): its message then says only that it was refused.
    """
    import torch

    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - only a detail for the message
        return []


def checkpoint_dir() -> Path | None:
    """This task's checkpoint directory, or None when the run has none.

    ``checkpoint_dir="file:///shared/ckpt"`` names the local path ``/shared/ckpt``, as it does for
    the hook's check before the run (``preflight.check_checkpoint_dir``).
    """
    value = os.environ.get(CHECKPOINT_ENV)
    if value and value[:7].lower() == "file://":
        value = value[7:]
    return Path(value) if value else None


def save_checkpoint(
    state: Any, step: int, *, keep: int = 2, all_ranks: bool = False, weights_only: bool = True
) -> Path | None:
    """Write ``state`` as the checkpoint of ``step`` (global rank 0 only, unless ``all_ranks``).

    Written to a temporary name and renamed, so a rank killed mid-write never leaves a torn
    checkpoint that a restart would load. Keeps the newest ``keep`` checkpoints.

    With ``weights_only`` (the default) a state that :func:`load_latest_checkpoint` would refuse
    (a numpy array, an object of your own class not allowed with
    ``torch.serialization.add_safe_globals``) raises :class:`CheckpointRefused` and is not kept.
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
    if weights_only:
        # Reads only the pickle's opcodes (not the tensors): cheap, and the same allow-list the load uses.
        unsafe = _unsafe_globals(tmp)
        if unsafe:
            tmp.unlink(missing_ok=True)
            raise CheckpointRefused(
                f"save_checkpoint(step={step}) refused the state: it holds {unsafe}, which "
                "load_latest_checkpoint would not unpickle (it loads tensors, numbers, strings and "
                f"plain containers only, weights_only=True). {_OPT_IN}"
            )
    os.replace(tmp, final)
    for old in sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_latest_checkpoint(map_location: Any = "cpu", *, weights_only: bool = True) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint, or None when there is none yet.

    Loaded with ``torch.load(..., weights_only=True)``: tensors, numbers, strings and plain
    containers, so a model's or an optimizer's ``state_dict``. A file holding anything else raises
    :class:`CheckpointRefused` naming it; nothing in it runs. Allow classes of your own with
    ``torch.serialization.add_safe_globals([MyConfig])`` before the call.

    ``weights_only=False`` unpickles the file in full. **That runs any code the file holds**, and
    the checkpoint directory is one that every executor of the run (every node's ranks) can
    write: one compromised executor could plant a newer ``step-*.pt`` and take over rank 0 on the
    next restart, and with it the run's output. Use it only when every host that runs the
    training is trusted as much as the Airflow worker.
    """
    import torch

    directory = checkpoint_dir()
    if directory is None or not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    if not found:
        return None
    latest = found[-1]
    try:
        state = torch.load(latest, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        # torch's own message is about its 2.6 default; say what this file holds and what to do.
        held = f"it holds {unsafe}" if (unsafe := _unsafe_globals(latest)) else "its pickle was refused"
        raise CheckpointRefused(
            f"load_latest_checkpoint refused {latest}: {held}, objects beyond tensors, numbers, "
            "strings and plain containers, and unpickling them could run code from whoever wrote "
            "the file (every executor of the run can write this directory). Nothing in it was run. "
            f"{_OPT_IN}"
        ) from exc
    return int(_NAME.match(latest.name)[1]), state
