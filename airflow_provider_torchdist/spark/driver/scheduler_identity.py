"""Ask Spark's scheduler where a barrier task runs: the ground truth a node's identity is bound to.

A node's agent says "I run partition n as task attempt t". Every executor could say that, so the
driver asks Spark which host runs task attempt ``t`` of partition ``n`` in this run's job group, and
checks that the connection comes from there (:func:`channel_auth.peer_matches`).
"""

from __future__ import annotations

import time
from typing import Any

from airflow_provider_torchdist.spark.driver.jvm_status import stage_tasks
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused, peer_matches


def group_tasks(sc: Any, job_group: str) -> list[tuple[int, int, str, str, str]]:
    """``(task attempt id, partition, host, status, executor id)`` of the tasks of the current
    attempt of every stage of the job group's jobs."""
    tracker = sc.statusTracker()
    found = []
    for job_id in tracker.getJobIdsForGroup(job_group):
        job = tracker.getJobInfo(job_id)
        for stage_id in list(job.stageIds) if job else []:
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                found += stage_tasks(sc, stage_id, stage.currentAttemptId)
    return found


class SchedulerVerifier:
    """A :data:`~airflow_provider_torchdist.spark.wire.channel_auth.NodeVerifier` backed by Spark's scheduler.

    Spark's status store learns of a task's start through its listener bus, a moment after the
    task itself starts: a lookup waits up to ``timeout`` seconds for it.
    """

    def __init__(self, sc: Any, job_group: str, timeout: float = 10.0) -> None:
        self._sc = sc
        self._group = job_group
        self._timeout = timeout

    def host_of(self, node: int, task_attempt: int) -> str | None:
        for task_id, partition, host, status, _ in group_tasks(self._sc, self._group):
            if task_id == task_attempt and partition == node and status == "RUNNING":
                return host
        return None

    def __call__(self, node: int, task_attempt: int, peer_ip: str) -> str:
        deadline = time.monotonic() + self._timeout
        while (host := self.host_of(node, task_attempt)) is None:
            if time.monotonic() >= deadline:
                raise HelloRefused(
                    f"Spark's scheduler runs no task attempt {task_attempt} of partition {node} in this run"
                )
            time.sleep(0.02)
        if not peer_matches(peer_ip, host):
            raise HelloRefused(f"node {node} runs on {host}, but this connection comes from {peer_ip}")
        return host
