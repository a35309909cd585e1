"""A graceful stop, as a rank sees it: :func:`stop_requested` and the stop signal.

When a run is stopped (a timeout, a kill, a clear; see ``stop_grace_period``), the driver sends
every rank a :class:`~airflow_provider_torchdist.spark.wire.protocol.StopRequest` over its run
channel. The rank's channel reader (a thread) calls :func:`request_stop`, which

1. makes :func:`stop_requested` True, for the training loop to checkpoint and return::

       for step in range(start, steps):
           train_one_step()
           if stop_requested(all_ranks=True):   # every rank stops at the same step
               save_checkpoint({"model": model.state_dict()}, step + 1)
               return

2. and sends this process ``stop_signal`` (SIGTERM by default), for code that handles it its own way
   (a handler installed with ``signal.signal``, as under SLURM's ``--signal``).

The rank answers whether its code watches for stops (it has asked :func:`stop_requested`, or
has a handler of its own for the signal): when no rank does, the run is killed at once rather
than after a grace period that would save nothing.

A rank whose code has no handler of its own for that signal is not ended by it: the handler
:func:`install` puts in place at the rank's start lets exactly that one signal pass. Any other
delivery of it (torchrun's agent ending its ranks when the run is killed, before or after a
stop) does what it did before: the hard path is not slowed by a rank that ignores SIGTERM.

Standard library only (it runs in the ranks).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from airflow_provider_torchdist.spark.node.progress import note_progress

_requested = threading.Event()
#: Re-entrant: the signal handler runs in the main thread, which may hold it at that moment.
_lock = threading.RLock()
#: Signals this process sent itself for a stop and that the handler has yet to absorb.
_expected = 0
_reason: str | None = None
_deadline: float | None = None
_previous: dict[int, Any] = {}
#: Whether this rank's code has asked :func:`stop_requested` yet (it watches for stops).
_watching = False


def stop_requested(all_ranks: bool = False) -> bool:
    """True once this run is being stopped: checkpoint and return (before ``stop_grace_period``
    runs out, when what is left of the run is killed). Always False outside a run.

    The request reaches the ranks a few milliseconds apart, so two ranks asking at the same step
    may get different answers, and a rank that leaves its loop while the others go on to the next
    step's all-reduce leaves them waiting for it. ``all_ranks=True`` gives every rank the same
    answer: an all-reduce of the flag over the default process group, so every rank must call it
    at the same point (once per step, say) as with any collective::

        for step in range(start, steps):
            train_one_step()
            if stop_requested(all_ranks=True):
                save_checkpoint({"model": model.state_dict()}, step + 1)
                return
    """
    global _watching
    _watching = True
    note_progress()  # a check per step: the hang watchdog counts it as progress
    local = _requested.is_set()
    if not all_ranks:
        return local
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stop_details() -> tuple[str | None, float | None]:
    """Why the run is being stopped ("timeout", ...) and the seconds left of its grace period
    (None, None before a stop)."""
    with _lock:
        left = None if _deadline is None else max(0.0, _deadline - time.monotonic())
        return _reason, left


#: Seconds past its grace period that a rank of an elastic run waits for the driver to restart its
#: worker group after a node was decommissioned (:func:`wait_for_regroup`).
REGROUP_WAIT_S = 60.0


def wait_for_regroup() -> None:
    """An elastic run's rank whose code returned after a stop for a decommissioned node (its
    checkpoint written): its worker group is about to be restarted without that node, so it must
    not end as a finished run would (rank 0's value is not the run's result). It waits for the
    driver to end it (:mod:`~airflow_provider_torchdist.spark.driver.decommission`); it never returns, and raises if the
    driver has not ended it :data:`REGROUP_WAIT_S` past the grace period."""
    with _lock:
        deadline = _deadline
    left = (0.0 if deadline is None else max(0.0, deadline - time.monotonic())) + REGROUP_WAIT_S
    time.sleep(left)
    raise RuntimeError(
        f"this rank checkpointed for a decommissioned node and waited {left:.0f} s for its worker group "
        "to be restarted without it, but the driver did not restart it"
    )


def install(signame: str) -> None:
    """In the rank's main thread, at its start: the handler that lets a stop's own signal pass.

    Signal handlers can only be set from the main thread; the stop arrives in another one."""
    sig = signal.Signals[signame]
    previous = signal.getsignal(sig)
    if previous is _absorb_stop_signal:
        return
    _previous[sig] = previous
    signal.signal(sig, _absorb_stop_signal)


def request_stop(reason: str, grace: float, signame: str) -> bool:
    """The driver asked this rank to stop (from the channel reader's thread): see the module
    docstring. Returns whether the rank's code watches for stops: it has asked
    :func:`stop_requested`, or handles the stop signal itself (False also for a repeated request)."""
    global _expected, _reason, _deadline
    with _lock:
        if _requested.is_set():
            return False
        _reason, _deadline = reason, time.monotonic() + grace
        _requested.set()
        sig = signal.Signals[signame]
        handler = signal.getsignal(sig)
        own = handler is _absorb_stop_signal
        if own:
            _expected += 1
        users = not own and handler not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
        watching = _watching or users
    # Whose handler it is decides only whether ours lets it pass: a handler the user installed
    # since (theirs replaced ours) is theirs to act on.
    os.kill(os.getpid(), sig)
    return watching


def _absorb_stop_signal(signum: int, frame: FrameType | None) -> None:
    global _expected
    with _lock:
        if _expected > 0:
            _expected -= 1
            return  # the stop's own signal: stop_requested() says the rest
    # Any other delivery: what the signal did before this handler (by default, end the process).
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
