"""The one seam into the Spark driver's JVM: what PySpark's public API does not say about a run.

PySpark's ``StatusTracker`` stops at job and stage counts. The driver needs more facts, all
from the JVM ``SparkContext`` through py4j (``sc._jsc``, ``sc._jvm``), and only here:

- the live executors, with their hosts and running tasks (:mod:`.executor_loss`);
- which host and executor run which partition of a stage attempt (:mod:`.scheduler_identity`);
- how many tasks the application can run at once (:mod:`.slots`);
- which executors Spark is decommissioning, and a task attempt's kill (:mod:`.decommission`).

Every distributed run in ``tests/integration`` goes through the first three, and the decommission
tests (``test_worker_loss.py``) through the last, so a change upstream fails there loudly, naming
this module.
"""

from __future__ import annotations

from typing import Any


def _jvm_context(sc: Any) -> Any:
    return sc._jsc.sc()


def executor_infos(sc: Any) -> list[tuple[str, int, int]]:
    """``(host, block manager port, running tasks)`` of each live executor (and the driver)."""
    tracker = _jvm_context(sc).statusTracker()
    return [(str(e.host()), int(e.port()), int(e.numRunningTasks())) for e in tracker.getExecutorInfos()]


def stage_tasks(sc: Any, stage_id: int, stage_attempt: int) -> list[tuple[int, int, str, str, str]]:
    """``(task attempt id, partition, host, status, executor id)`` of a stage attempt's tasks
    (Spark's status store)."""
    jvm_tasks = _jvm_context(sc).statusStore().taskList(stage_id, stage_attempt, 1 << 20)
    tasks = sc._jvm.scala.jdk.javaapi.CollectionConverters.asJava(jvm_tasks)
    return [
        (int(t.taskId()), int(t.index()), str(t.host()), str(t.status()), str(t.executorId())) for t in tasks
    ]


def decommissioning_executors(sc: Any) -> list[str]:
    """The ids of the executors Spark is decommissioning (``spark.decommission.enabled``): their
    running tasks go on for now, but their node is going away. The scheduler's own map, read without
    its lock: a read that races a change raises, and the caller reads again at its next poll."""
    pending = _jvm_context(sc).taskScheduler().executorsPendingDecommission()
    return [str(e) for e in sc._jvm.scala.jdk.javaapi.CollectionConverters.asJava(pending.keySet())]


def executor_address(sc: Any, executor_id: str) -> str:
    """``host:port`` of an executor's block manager: the key :mod:`.executor_loss` knows it by."""
    return str(_jvm_context(sc).statusStore().executorSummary(executor_id).hostPort())


def kill_task_attempt(sc: Any, task_id: int, reason: str) -> bool:
    """Kill one task attempt (Spark runs it again elsewhere when it can); whether Spark found it."""
    return bool(_jvm_context(sc).killTaskAttempt(task_id, True, reason))


def max_concurrent_tasks(sc: Any) -> int:
    """How many tasks of the default resource profile the application can run at once."""
    jsc = _jvm_context(sc)
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
