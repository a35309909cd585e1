"""Executor loss: the watch that notices a busy executor vanish, and the message that names its host."""

from __future__ import annotations

from types import SimpleNamespace

from airflow_provider_torchdist.errors import TrainingFailed
from airflow_provider_torchdist.spark.driver.executor_loss import (
    ExecutorWatch,
    lost_executor_message,
    wait_for_loss,
)
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from tests.unit.conftest import wait_until


class FakeTracker:
    def __init__(self) -> None:
        self.executors: list[tuple[str, int, int]] = []  # host, block manager port, running tasks

    def getExecutorInfos(self):  # noqa: N802 - Spark's name
        return [
            SimpleNamespace(host=lambda h=h: h, port=lambda p=p: p, numRunningTasks=lambda n=n: n)
            for h, p, n in self.executors
        ]


def _watch(tracker: FakeTracker, calls: list[int]) -> ExecutorWatch:
    sc = SimpleNamespace(_jsc=SimpleNamespace(sc=lambda: SimpleNamespace(statusTracker=lambda: tracker)))
    return ExecutorWatch(sc, lambda: calls.append(1), every=0.01)


def test_a_busy_executor_that_vanishes_is_lost_and_triggers_the_cancel() -> None:
    tracker, calls = FakeTracker(), []
    tracker.executors = [("10.0.0.1", 4040, 0), ("10.0.0.11", 40001, 1), ("10.0.0.12", 40002, 1)]
    watch = _watch(tracker, calls)
    assert not wait_for_loss(watch, 0.1)  # nothing lost yet: returns after the timeout
    with watch:
        tracker.executors = [("10.0.0.1", 4040, 0), ("10.0.0.11", 40001, 0)]
        wait_until(lambda: calls, what="the watch to cancel the stage")
    assert watch.lost == {"10.0.0.12:40002": "10.0.0.12"}


def test_an_idle_executor_that_goes_away_is_not_a_loss() -> None:
    tracker, calls = FakeTracker(), []
    tracker.executors = [("10.0.0.1", 4040, 0), ("10.0.0.13", 40003, 0)]
    watch = _watch(tracker, calls)
    watch.poll()
    tracker.executors = [("10.0.0.1", 4040, 0)]
    assert watch.poll() == []
    assert not watch.lost and not calls


def test_message_names_the_host_nodes_and_ranks() -> None:
    text = lost_executor_message(["10.0.0.12"], {0: "10.0.0.11", 1: "10.0.0.12"}, nproc_per_node=2)
    assert text.startswith("Spark lost the executor on 10.0.0.12 that ran node(s) [1] (rank(s) [2, 3])")
    assert "Worker or executor died" in text


def test_training_failed_puts_the_runs_own_error_first() -> None:
    failure = RankFailure(
        rank=0, host="10.0.0.11", exc_type="RuntimeError", message="Connection closed by peer"
    )
    text = str(TrainingFailed([failure], "Spark lost the executor on 10.0.0.12"))
    assert text.startswith(
        "Distributed training failed: Spark lost the executor on 10.0.0.12; rank 0 on 10.0.0.11"
    )


def test_an_executor_expected_to_go_is_no_loss() -> None:
    """A decommissioned executor ends once its node's ranks have returned: no cancel."""
    tracker, calls = FakeTracker(), []
    tracker.executors = [("10.0.0.11", 40001, 1), ("10.0.0.12", 40002, 1)]
    watch = _watch(tracker, calls)
    watch.poll()
    watch.expect_gone({"10.0.0.12:40002"})
    tracker.executors = [("10.0.0.11", 40001, 1)]
    assert watch.poll() == [] and not watch.lost
