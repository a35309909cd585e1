"""Executor loss: notice when Spark loses an executor that runs one of the barrier tasks.

When a Worker or executor dies mid-training, its ranks vanish. The ranks on the other hosts may
notice at once (their gloo peers' sockets close) or block in a collective until its timeout (the
host is unreachable, nothing closes). The driver must not wait for either: Spark's scheduler knows
the executor is gone, so the driver watches Spark's list of live executors, cancels the stage the
moment a busy one disappears, and says which host it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.driver.jvm_status import executor_infos


class ExecutorWatch:
    """Polls Spark's live executors while the barrier stage runs; remembers the busy ones that vanish.

    Example::

        with ExecutorWatch(sc, on_lost=lambda: sc.cancelJobGroup(group)) as watch:
            rdd.collect()
        watch.lost  # {"10.0.0.12:40123": "10.0.0.12"}
    """

    def __init__(self, sc: Any, on_lost: Callable[[], None], every: float = 0.5) -> None:
        self._sc = sc
        self._on_lost = on_lost
        self._every = every
        self._busy: dict[str, str] = {}
        #: Executors ("host:port" of their block manager) that disappeared while running a task: their hosts.
        self.lost: dict[str, str] = {}
        #: Executors whose end is no loss: Spark decommissioned them, and they leave once their
        #: node's ranks have checkpointed (:mod:`.decommission`).
        self._leaving: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchdist-executor-watch", daemon=True)

    def __enter__(self) -> ExecutorWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def expect_gone(self, addresses: set[str]) -> None:
        """These executors will end, and that is no loss (a decommissioned node leaving)."""
        self._leaving |= addresses

    def poll(self) -> list[str]:
        """Check once; return the executors newly found lost."""
        live = {f"{host}:{port}": (host, running) for host, port, running in executor_infos(self._sc)}
        self._busy.update({address: host for address, (host, running) in live.items() if running > 0})
        new = [a for a in self._busy if a not in live and a not in self.lost and a not in self._leaving]
        for address in new:
            self.lost[address] = self._busy[address]
        return new

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                if self.poll():
                    self._on_lost()
            except Exception:  # the SparkContext is stopping: nothing left to watch
                return


def lost_executor_message(
    lost_hosts: list[str], node_hosts: dict[int, str | None], nproc_per_node: int
) -> str:
    """What the task log and the task's error say when Spark lost executors running the training."""
    parts = []
    for host in sorted(set(lost_hosts)):
        nodes = sorted(n for n, h in node_hosts.items() if h == host)
        ranks = [r for n in nodes for r in range(n * nproc_per_node, (n + 1) * nproc_per_node)]
        ran = f" that ran node(s) {nodes} (rank(s) {ranks})" if nodes else ""
        parts.append(f"{host}{ran}")
    return (
        f"Spark lost the executor on {', '.join(parts)} in the middle of training: its Worker or executor "
        "died, or the host became unreachable. The barrier stage was cancelled, so the ranks on the other "
        "hosts were stopped too. Check that host's Spark Worker and executor logs; a retry of the task "
        "starts the run again on the executors the cluster has then."
    )


def wait_for_loss(watch: ExecutorWatch, timeout: float) -> bool:
    """Poll until an executor is found lost or ``timeout`` passes (Spark's status store lags a little)."""
    deadline = time.monotonic() + timeout
    while not watch.lost:
        watch.poll()
        if watch.lost or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return bool(watch.lost)
