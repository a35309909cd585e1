"""Asynchronous checkpoint saves: ``save_checkpoint(..., asynchronous=True)`` returns once the state
is staged (copied, so training may change its tensors at once), and the write and upload go on in
a thread beside training.

The copy goes into buffers kept from one save to the next (one copy of the state's tensors stays
allocated, on the CPU, or on the GPU for a ``DTensor`` there). At most one save is in flight per process: the next save waits for it, and so does the end of the
rank's work (:func:`wait_for_checkpoints`, called by the rank runtime after the training function
or script returns, so a graceful stop and a finished run both end with the checkpoint committed).
A sharded save's ranks coordinate over torch.distributed: training code that ends with
``dist.destroy_process_group()`` calls :func:`wait_for_checkpoints` before it.
A save that failed raises :class:`CheckpointSaveFailed` there, naming the checkpoint, and fails the
run. Runs on the Spark side: imports no Airflow.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CheckpointSaveFailed", "stage", "start", "wait_for_checkpoints"]


class CheckpointSaveFailed(RuntimeError):
    """An asynchronous checkpoint save failed (its write or upload): the run fails with it, and
    the checkpoint was not committed."""


class _Save(threading.Thread):
    def __init__(self, save: Callable[[], Any], step: int, where: str) -> None:
        super().__init__(name=f"torchdist-checkpoint-{step}", daemon=True)
        self._save, self.step, self.where = save, step, where
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._save()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self.error = exc


_in_flight: _Save | None = None
_lock = threading.Lock()
#: Staging buffers, by the tensor's place in the state (keys and indexes): see :func:`stage`.
_buffers: dict[tuple, Any] = {}


def stage(state: Any, _path: tuple = ()) -> Any:
    """A copy of ``state`` that training cannot change: tensors copied (to the CPU; a ``DTensor``'s
    local shard where it is), containers rebuilt, other values deep-copied.

    The tensors are copied into buffers kept from the last save (one set per process, reused while
    the shapes match): a fresh allocation of a large state costs more in page faults than the copy
    itself. Call it only once the save before is done (:func:`wait_for_checkpoints`): that save
    reads the same buffers.
    """
    import torch

    if isinstance(state, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(state, DTensor):
            local = state.to_local().detach()
            shard = _buffer(_path, local, local.device)
            shard.copy_(local)
            return DTensor.from_local(
                shard,
                state.device_mesh,
                state.placements,
                run_check=False,
                shape=state.shape,
                stride=state.stride(),
            )
        buffer = _buffer(_path, state, torch.device("cpu"))
        buffer.copy_(state.detach())
        return buffer
    if isinstance(state, dict):
        staged = copy.copy(state)
        for key, value in state.items():
            staged[key] = stage(value, (*_path, key))
        return staged
    if isinstance(state, list | tuple) and type(state) in (list, tuple):
        return type(state)(stage(value, (*_path, i)) for i, value in enumerate(state))
    return copy.deepcopy(state)


def _buffer(path: tuple, like: Any, device: Any) -> Any:
    """The staging buffer for the tensor at ``path``: last save's when it has ``like``'s shape,
    dtype and device, else a new one."""
    import torch

    kept = _buffers.get(path)
    if kept is None or kept.shape != like.shape or kept.dtype != like.dtype or kept.device != device:
        kept = _buffers[path] = torch.empty(like.shape, dtype=like.dtype, device=device)
    return kept


def start(save: Callable[[], Any], step: int, where: str) -> None:
    """Run ``save`` (the staged checkpoint's write and commit) in a thread, after the save before
    it (raising :class:`CheckpointSaveFailed` if that one failed)."""
    global _in_flight
    wait_for_checkpoints()
    with _lock:
        _in_flight = _Save(save, step, where)
        _in_flight.start()


def wait_for_checkpoints() -> None:
    """Wait for the asynchronous checkpoint save in flight, if any (every rank, for a sharded one);
    :class:`CheckpointSaveFailed` when it failed. Call it before ``dist.destroy_process_group()``:
    a sharded save in flight needs the process group."""
    global _in_flight
    with _lock:
        pending, _in_flight = _in_flight, None
    if pending is None:
        return
    pending.join()
    if pending.error is not None:
        raise CheckpointSaveFailed(
            f"the asynchronous save of checkpoint step {pending.step} ({pending.where}) failed, so "
            f"it was not committed: {type(pending.error).__name__}: {pending.error}{_hint()}"
        ) from pending.error


def _hint() -> str:
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        return (
            ". torch.distributed was shut down (dist.destroy_process_group()) while the save was in "
            "flight, and a sharded save needs it: call wait_for_checkpoints() before destroy_process_group()"
        )
    return ""
