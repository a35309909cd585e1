"""Barrier-stage slot checks: fail fast when the cluster can never fit the job, say so while it waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.driver.jvm_status import max_concurrent_tasks
from airflow_provider_torchdist.spark.driver.master_state import slot_holders


class SlotsUnavailable(RuntimeError):
    """The cluster has fewer task slots than the barrier stage (an elastic run: its MIN) needs."""

    def __init__(self, needed: int, available: int, detail: str, elastic: bool = False) -> None:
        self.needed, self.available = needed, available
        what, why = (
            ("The elastic run needs at least", "an elastic run cannot start until its MIN's tasks fit")
            if elastic
            else ("The barrier stage needs", "a barrier stage cannot start until all its tasks fit")
        )
        super().__init__(
            f"{what} {needed} task slot(s) at once but the cluster has {available} ({detail}). Lower "
            f"num_processes, raise nproc_per_node, or give the cluster more executors/cores; {why}."
        )


def available_slots(sc: Any) -> int:
    """How many tasks of the default resource profile this application can run at once."""
    return max_concurrent_tasks(sc)


def wait_for_slots(
    sc: Any,
    needed: int,
    timeout: float | None,
    say: Callable[[str], None],
    settle: float = 6.0,
    poll: float = 0.25,
    holders: Callable[[], str] | None = None,
) -> int:
    """Return once the application has ``needed`` slots; raise :class:`SlotsUnavailable` otherwise.

    A ``local[N]`` master has all its slots from the start, so a shortfall there fails at once.
    On a cluster, executors register over the first seconds. Without knowing the cluster's size,
    the wait ends ``settle`` seconds after the last executor arrived (a standalone master grants
    every executor it can at once, so a count that stopped growing is what the cluster offers),
    and at ``timeout`` at the latest. Executors granted together can still register far apart on a
    loaded cluster, so ``settle`` grows to the time the first executor took to arrive: a straggler
    gets as long again as the first one needed (an empty count keeps waiting for slow YARN or Kubernetes
    executors until then). Spark's own check would wait about 10 minutes (15 s x 40 tries).
    ``timeout`` None means the cluster is known to fit the stage: wait as long as other work
    holds the slots. ``holders`` says what holds the missing slots, as the master reports it
    (:func:`~airflow_provider_torchdist.spark.driver.master_state.slot_holders`).
    """
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    announced = 0.0
    last, last_change = -1, start
    while True:
        have = available_slots(sc)
        if have >= needed:
            return have
        now = time.monotonic()
        if have != last:
            if last <= 0 < have:
                settle = max(settle, now - start)
            last, last_change = have, now
        settled = deadline is not None and have > 0 and now - last_change >= settle
        if sc.master.startswith("local") or settled or (deadline is not None and now >= deadline):
            detail = f"master {sc.master}, spark.task.cpus={task_cpus}"
            if not sc.master.startswith("local"):
                detail += (
                    f"; waited {now - start:.0f}s for executors, so the cluster may also just be busy: give "
                    "the connection the master's web UI (extra master-web-ui) to wait for busy slots instead"
                )
            raise SlotsUnavailable(needed, have, detail)
        if now - announced >= 10:
            limit = "" if deadline is None else f" (giving up after {timeout:.0f}s)"
            why = holders() if holders is not None else slot_holders(None, None)
            say(f"waiting for executors: {have} of {needed} task slot(s) so far; {why}{limit}")
            announced = now
        time.sleep(poll)
