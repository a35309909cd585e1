"""A checkpoint's state as bytes, and back: ``torch.save`` out, ``torch.load(weights_only=True)`` in.

``weights_only`` (the default both ways) keeps to tensors, numbers, strings and plain containers
(a model's or an optimizer's ``state_dict``): every executor of a run can write its checkpoint
store, so a full unpickle would let any one of them run code wherever the checkpoint is loaded
next (rank 0 on a restart, a downstream Airflow task). A state that such a load would refuse is
refused when it is saved, so a run learns it at its first checkpoint.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

OPT_IN = (
    "If the objects are yours, allow their classes by name with "
    "torch.serialization.add_safe_globals([...]) at the top of the training function, or save "
    "plain data (tensors, numbers, strings, lists, dicts: a state_dict()); only if every process "
    "that can write the checkpoint store is trusted, pass weights_only=False (to "
    "save_checkpoint and load_latest_checkpoint / load_checkpoint), which runs whatever code the file holds."
)


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint holds objects that a ``weights_only`` load does not create.

    Raised when loading a checkpoint that holds them, and by ``save_checkpoint`` for a state that
    such a load would refuse (so the run fails at its first checkpoint, not at the restart that
    needs it). The message names the checkpoint and the classes or functions it holds, and says
    how to opt in.
    """


def unsafe_globals(source: BinaryIO) -> list[str]:
    """The classes and functions in a ``torch.save`` file (read from its start) that a
    ``weights_only`` load refuses.

    Read statically, nothing unpickled; empty for a file that is not torch.save's zip format (a
    legacy pickle or garbage): its message then says only that it was refused.
    """
    import torch

    try:
        source.seek(0)
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - only a detail for the message
        return []


def weights_only_refusal(path: str) -> str | None:
    """Why ``torch.load(path, weights_only=True)`` does not take the file, or None when it does.

    The file is loaded (tensors memory-mapped, not read): unlike :func:`unsafe_globals`, which
    says nothing of a file it cannot read statically (a legacy pickle, pickle protocol 4's
    ``STACK_GLOBAL``, a torch without the function), this fails closed, so a file a full unpickle
    would run is refused whatever form it takes.
    """
    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - whatever the load refuses, the resume refuses
        with open(path, "rb") as source:
            unsafe = unsafe_globals(source)
        if unsafe:
            return f"it holds {unsafe}, which a weights_only load would not unpickle"
        return f"a weights_only load does not take it ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def dump_state(state: Any, step: int, out: BinaryIO, *, weights_only: bool = True) -> None:
    """``torch.save(state)`` into ``out`` (open for writing and reading); with ``weights_only``,
    refused (``CheckpointRefused``) when a ``weights_only`` load would refuse it."""
    import torch

    torch.save(state, out)
    # Reads only the pickle's opcodes (not the tensors): cheap, and the same allow-list the load uses.
    if weights_only:
        out.flush()
        if unsafe := unsafe_globals(out):
            raise CheckpointRefused(
                f"save_checkpoint(step={step}) refused the state: it holds {unsafe}, which a "
                "weights_only load would not unpickle (it loads tensors, numbers, strings and plain "
                f"containers only, weights_only=True). {OPT_IN}"
            )


def load_state(
    source: BinaryIO | bytes, where: str, *, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """``torch.load`` of a checkpoint's state (an open file, or bytes); ``where`` names it in a refusal."""
    import torch

    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        # torch's own message is about its 2.6 default; say what this file holds and what to do.
        held = f"it holds {unsafe}" if (unsafe := unsafe_globals(source)) else "its pickle was refused"
        raise CheckpointRefused(
            f"refused to load the checkpoint {where}: {held}, objects beyond tensors, numbers, "
            "strings and plain containers, and unpickling them could run code from whoever wrote "
            "it (every executor of the run can write the checkpoint store). Nothing in it was run. "
            f"{OPT_IN}"
        ) from exc
