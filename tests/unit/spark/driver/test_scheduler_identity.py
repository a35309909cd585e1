"""The driver's two reads of PySpark internals, and what is built on them, without a JVM.

``release_accumulator_server`` and ``jvm_status`` are the two allowed seams (``test_spec.py``).
Upstream renames must fail here, loudly, not leave a slower or blind driver behind.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_torchdist.spark.driver import scheduler_identity
from airflow_provider_torchdist.spark.driver.scheduler_identity import SchedulerVerifier
from airflow_provider_torchdist.spark.driver.spark_context import release_accumulator_server
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused


def test_pyspark_still_keeps_the_accumulator_server_where_the_seam_reads_it() -> None:
    import pyspark.accumulators
    from pyspark.core import context

    # SparkContext sets it in its init and shuts it down in stop(); the handler's loop checks the flag.
    assert "self._accumulatorServer = " in inspect.getsource(context.SparkContext)
    assert "self._accumulatorServer.shutdown()" in inspect.getsource(context.SparkContext.stop)
    assert "server_shutdown" in inspect.getsource(pyspark.accumulators)


def test_release_accumulator_server_ends_its_loop_and_lets_stop_skip_it() -> None:
    server = SimpleNamespace(server_shutdown=False)
    sc = SimpleNamespace(_accumulatorServer=server)
    release_accumulator_server(sc)
    assert server.server_shutdown is True and sc._accumulatorServer is None
    release_accumulator_server(sc)  # again, or on a context without one: nothing to do


class FakeTracker:
    """PySpark's StatusTracker over one job group: job 7 with stages 3 (attempt 1) and 4 (gone)."""

    def getJobIdsForGroup(self, group: str) -> list[int]:
        return [7] if group == "torchdist-run" else []

    def getJobInfo(self, job_id: int) -> Any:
        return SimpleNamespace(stageIds=[3, 4])

    def getStageInfo(self, stage_id: int) -> Any:
        return SimpleNamespace(currentAttemptId=1) if stage_id == 3 else None


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> SchedulerVerifier:
    tasks = {
        (3, 1): [
            (101, 0, "10.0.0.1", "RUNNING", "1"),
            (102, 1, "10.0.0.2", "RUNNING", "2"),
            (99, 1, "10.0.0.3", "FAILED", "3"),
        ]
    }
    monkeypatch.setattr(
        scheduler_identity, "stage_tasks", lambda sc, stage, attempt: tasks.get((stage, attempt), [])
    )
    return SchedulerVerifier(SimpleNamespace(statusTracker=FakeTracker), "torchdist-run", timeout=0.2)


def test_the_scheduler_says_which_host_runs_a_partitions_task_attempt(verifier: SchedulerVerifier) -> None:
    assert verifier.host_of(0, 101) == "10.0.0.1"
    assert verifier.host_of(1, 102) == "10.0.0.2"
    assert verifier(1, 102, "10.0.0.2") == "10.0.0.2"


@pytest.mark.parametrize(
    "node, attempt, peer, why",
    [
        (1, 101, "10.0.0.1", "no task attempt 101 of partition 1"),  # attempt of another partition
        (1, 99, "10.0.0.3", "no task attempt 99 of partition 1"),  # an attempt that is not running
        (5, 500, "10.0.0.1", "no task attempt 500 of partition 5"),  # nothing like it
        (0, 101, "10.0.0.2", "node 0 runs on 10.0.0.1, but this connection comes from 10.0.0.2"),
    ],
)
def test_a_claim_the_scheduler_does_not_back_is_refused(
    verifier: SchedulerVerifier, node: int, attempt: int, peer: str, why: str
) -> None:
    with pytest.raises(HelloRefused, match=why):
        verifier(node, attempt, peer)
