"""A process's bond to the one that started it: the kernel signals it when its parent dies.

``prctl(PR_SET_PDEATHSIG)``: the signal comes when the *thread* that forked the process ends, it
survives ``exec`` (a shell script that execs java keeps it), and it needs no PID of the parent, so
PID reuse cannot fool it. Linux only; elsewhere these do nothing. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


#: Looked up once, here: a child between fork and exec should do as little as it can.
_PRCTL = _prctl()


def die_with_parent(sig: signal.Signals = signal.SIGKILL, *, parent_may_be_init: bool = False) -> None:
    """Have the kernel send this process ``sig`` when its parent dies; exit at once when the parent
    is gone by the time the bond holds."""
    if _PRCTL is None:
        return
    parent = os.getppid()
    _PRCTL(_PR_SET_PDEATHSIG, int(sig))
    # Reparented before the bond held; or already an orphan of init, unless the parent may truly be
    # PID 1 (spark-submit's JVM as a container's entry point).
    if os.getppid() != parent or (parent == 1 and not parent_may_be_init):
        os._exit(1)


def signal_on_parent_death(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the thread that
    started it ends (that thread waits for the child, so only its process's death ends it)."""

    parent = os.getpid()  # the child's parent: this process

    def bond() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(sig))
            if os.getppid() != parent:  # this process died between the fork and the bond
                os._exit(1)

    return bond
