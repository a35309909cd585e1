"""What an elastic node does to its own ranks (this process's children) when the driver says so:
SIGKILL those started before a loss, so the agent restarts them (:class:`~.task.RestartWatch`), or
all of them and the agent too, when the node leaves the run (:mod:`.hung_nodes`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any


def stop_workers_started_before(seen_at: float) -> list[int]:
    """SIGKILL this agent's worker processes created before ``seen_at`` (epoch seconds, the
    driver's clock: hosts' clocks must agree to within about a second); returns their PIDs.

    SIGKILL, because a rank blocked in a collective does not run Python signal handlers. The
    agent sees the workers fail and restarts them (one of ``max_restarts``).

    A rank that is failing on its own (its peer's host just went) may be writing torchelastic's
    error file when the request comes, and torch writes it in place. Killed mid-write, it would
    leave a truncated file that fails the agent itself (``JSONDecodeError`` reading it, in
    ``ProcessFailure``) instead of a restart. So the workers are frozen first (SIGSTOP), and an error
    file one of them still holds open that does not parse is removed before the SIGKILL: the agent
    then sees a worker killed by a signal, and restarts it.
    """
    import psutil

    workers = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.create_time() < seen_at:
                child.suspend()
                workers.append(child)
    for child in workers:
        with contextlib.suppress(psutil.Error):
            wait_stopped(child)
            for held in child.open_files():
                if os.path.basename(held.path) == "error.json" and not _parses(held.path):
                    with contextlib.suppress(OSError):
                        os.unlink(held.path)
        with contextlib.suppress(psutil.Error):
            child.kill()
    return [child.pid for child in workers]


def wait_stopped(process: Any, timeout: float = 2.0) -> None:
    """Until ``process`` is stopped (a signal is delivered, not acted on, when ``kill`` returns)."""
    import psutil

    deadline = time.monotonic() + timeout
    while (
        process.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) and time.monotonic() < deadline
    ):
        time.sleep(0.005)


def _parses(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as file:
            json.load(file)
        return True
    except (OSError, ValueError):
        return False


def leave_the_run() -> list[int]:
    """This node leaves the elastic run (it runs in the agent's process, called by the agent's
    :class:`~.task.RestartWatch`): its ranks, this process's children, are killed by PID, and its
    torchrun agent is stopped with SIGTERM. Returns the ranks' PIDs.

    The ranks are frozen (SIGSTOP) before the agent's signal, so the agent cannot see them die and
    restart them first; torch's handler then raises ``SignalException`` in the agent (this process's
    main thread), which leaves the rendezvous open for the other nodes (torch closes it only when
    an agent ends otherwise), and the task ends as a node that left. SIGKILL ends a rank whatever
    it does (asleep, in a collective, itself stopped).
    """
    import psutil

    ranks = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            child.suspend()
            ranks.append(child)
    for child in ranks:
        with contextlib.suppress(psutil.Error):
            wait_stopped(child)
    os.kill(os.getpid(), signal.SIGTERM)
    for child in ranks:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return [child.pid for child in ranks]
