"""Barrier-stage slot checks: fail fast when the cluster can never fit the job, say so while it waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class SlotsUnavailable(RuntimeError):
    """The cluster has fewer task slots than the barrier stage needs."""

    def __init__(self, needed: int, available: int, detail: str) -> None:
        self.needed, self.available = needed, available
        super().__init__(
            f"The barrier stage needs {needed} task slot(s) at once but the cluster has {available} "
            f"({detail}). Lower num_processes, raise nproc_per_node, or give the cluster more "
            "executors/cores; a barrier stage cannot start until all its tasks fit."
        )


def available_slots(sc: Any) -> int:
    """How many tasks of the default resource profile this application can run at once."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def wait_for_slots(sc: Any, needed: int, timeout: float | None, say: Callable[[str], None]) -> int:
    """Return once the application has ``needed`` slots; raise :class:`SlotsUnavailable` otherwise.

    A ``local[N]`` master has all its slots from the start, so a shortfall there fails at once.
    On a cluster, executors register over the first seconds, so wait up to ``timeout`` for them.
    Spark's own check would wait about 10 minutes (15 s x 40 tries) before failing. ``timeout``
    None means the cluster is known to fit the stage: wait as long as other work holds the slots.
    """
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    deadline = None if timeout is None else time.monotonic() + timeout
    announced = 0.0
    while True:
        have = available_slots(sc)
        if have >= needed:
            return have
        now = time.monotonic()
        if sc.master.startswith("local") or (deadline is not None and now >= deadline):
            detail = f"master {sc.master}, spark.task.cpus={task_cpus}"
            if not sc.master.startswith("local"):
                detail += f"; waited {timeout:.0f}s for executors, so the cluster may also just be busy"
            raise SlotsUnavailable(needed, have, detail)
        if now - announced >= 10:
            limit = "" if deadline is None else f" (giving up after {timeout:.0f}s)"
            say(
                f"waiting for executors: {have} of {needed} task slot(s) so far; other work holds the rest{limit}"
            )
            announced = now
        time.sleep(0.25)
