"""Keeps every default process group a rank creates alive until the rank's process ends: a guard
against a deadlock in torch.

The deadlock (torch's pybind11 bindings; pytorch issue 56297, open): ``DistributedDataParallel``'s
``Reducer`` holds a reference to its process group and is freed with the GIL held. When the user's
code calls ``dist.destroy_process_group()`` and returns, the frame that held the DDP model goes, the
``Reducer`` drops the group's last reference, and gloo's destructor joins its worker threads, still
holding the GIL. A worker that is just freeing the last collective's work object needs the GIL for
it (the work keeps Python objects of the thread state it was issued in): neither moves, and the rank
hangs after its training finished. On a loaded 2-core machine about one run in four did; the hang
watchdog then named the rank as silent.

A reference of ours to the group means the ``Reducer`` never drops the last one. Ours is never
dropped either: a rank is a process torchrun's agent forks (``start_method="fork"``), which ends
with ``os._exit``, so gloo's destructor never runs. What the group holds (its sockets, idle worker
threads) goes with the process.

A thread looks for a new default group every :data:`LOOK_EVERY_S` (a module-level check: no
collective, no lock of torch's), so a group that lives longer than that is kept.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

#: How often the thread looks for a new default group.
LOOK_EVERY_S = 0.05

_kept: list[object] = []


def keep_default_group() -> bool:
    """Keep the current default process group (once); True when there is one."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return False
        group = dist.group.WORLD
    except Exception:  # a torch without distributed, a group being set up or torn down
        return False
    if group is not None and not any(kept is group for kept in _kept):
        _kept.append(group)
    return group is not None


def start(every: float = LOOK_EVERY_S) -> Callable[[], None]:
    """Start the thread that keeps each new default group; returns what stops it (what it kept
    stays kept)."""
    done = threading.Event()

    def look() -> None:
        while not done.wait(every):
            keep_default_group()

    threading.Thread(target=look, name="torchdist-group-keeper", daemon=True).start()
    return done.set
