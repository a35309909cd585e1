"""Spark decommissioning an executor that runs a node: the driver's graceful stop, without a JVM
(the real decommission of a Worker is in tests/integration/test_worker_loss.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchdist.spark.driver import decommission
from airflow_provider_torchdist.spark.driver.decommission import Decommissions, decommission_message
from airflow_provider_torchdist.spark.driver.executor_loss import ExecutorWatch
from airflow_provider_torchdist.spark.driver.stop_fanout import StopFanout
from airflow_provider_torchdist.spark.wire.protocol import StopRequest
from airflow_provider_torchdist.spark.wire.stop_request import DECOMMISSIONED, stop_declined
from tests.unit.conftest import wait_until


class FakeSpark:
    """What the decommission watch reads of Spark (jvm_status and the job group's tasks)."""

    def __init__(self) -> None:
        self.decommissioning: list[str] = []
        #: (task attempt id, partition, host, status, executor id) of the run's job group
        self.tasks = [(11, 0, "10.0.0.11", "RUNNING", "1"), (12, 1, "10.0.0.12", "RUNNING", "2")]
        self.killed: list[tuple[int, str]] = []


@pytest.fixture
def spark(monkeypatch: pytest.MonkeyPatch) -> FakeSpark:
    fake = FakeSpark()
    monkeypatch.setattr(decommission, "decommissioning_executors", lambda sc: list(fake.decommissioning))
    monkeypatch.setattr(decommission, "group_tasks", lambda sc, group: list(fake.tasks))
    monkeypatch.setattr(
        decommission, "executor_address", lambda sc, executor: f"10.0.0.1{executor}:4000{executor}"
    )

    def kill(sc: object, task: int, reason: str) -> bool:
        fake.killed.append((task, reason))
        fake.tasks = [(*t[:3], "KILLED" if t[0] == task else t[3], t[4]) for t in fake.tasks]
        return True

    monkeypatch.setattr(decommission, "kill_task_attempt", kill)
    monkeypatch.setattr(decommission, "MARGIN_S", 0.0)
    return fake


def _watch(
    tmp_path: Path, grace: float = 0.3, leave: Any = None
) -> tuple[Decommissions, StopFanout, list[str], list[int]]:
    lines: list[str] = []
    cancels: list[int] = []
    stops = StopFanout(tmp_path, lines.append)
    executors = ExecutorWatch(object(), lambda: None)
    watch = Decommissions(
        object(),
        "torchdist-run",
        stops,
        executors,
        lines.append,
        lambda: cancels.append(1),
        grace,
        2,
        leave=leave,
        every=0.01,
    )
    watch.executors = executors  # type: ignore[attr-defined]
    _connect_two_ranks(stops)
    return watch, stops, lines, cancels


def _connect_two_ranks(stops: StopFanout) -> None:
    """Two ranks connected (sockets of a pair nobody reads): the stop reaches them."""
    for rank in (0, 1):
        ours, theirs = socket.socketpair()
        stops.rank_connected(ours, rank)
        _KEEP.append((ours, theirs))


_KEEP: list[tuple[socket.socket, socket.socket]] = []


def test_the_runs_error_is_in_place_before_any_rank_has_the_stop(spark, tmp_path):
    """The stage can end as soon as the ranks have the request and return: the run's error must be
    set before it goes out (hunt 24: read between the two under load, it was still None)."""
    watches: list[Decommissions] = []
    at_send: list[str | None] = []

    def say(line: str) -> None:
        if line.startswith("the stop request"):  # the fanout says so, then sends
            at_send.append(watches[0].error)

    stops = StopFanout(tmp_path, say)
    executors = ExecutorWatch(object(), lambda: None)
    watches.append(
        Decommissions(object(), "torchdist-run", stops, executors, say, lambda: None, 0.3, 2, every=0.01)
    )
    _connect_two_ranks(stops)
    with watches[0]:
        spark.decommissioning = ["2"]
        wait_until(lambda: at_send, what="the stop request")
    assert at_send == [decommission_message(["10.0.0.12"], [1], 2, 0.3)]


def test_a_fixed_run_whose_nodes_executor_is_decommissioned_stops_gracefully_then_fails(spark, tmp_path):
    watch, stops, lines, cancels = _watch(tmp_path)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: stops.request is not None, what="the stop request")
        assert stops.request == StopRequest(DECOMMISSIONED, 0.3)
        assert watch.error == decommission_message(["10.0.0.12"], [1], 2, 0.3)
        assert watch.error.startswith("node decommissioned: Spark decommissioned the executor on 10.0.0.12")
        assert "node(s) [1] (rank(s) [2, 3])" in watch.error and "retry" in watch.error
        # The ranks outlast the grace period: the stage is cancelled.
        wait_until(lambda: cancels, what="the cancel after the grace period")
    assert any("Spark is decommissioning the executor on 10.0.0.12 (node(s) [1])" in line for line in lines)
    assert not stop_declined(tmp_path)  # the driver's own stop: no supervisor waits on that file
    # The executor leaves once its node's ranks returned: that is no loss for the executor watch.
    assert watch.executors._leaving == {"10.0.0.12:40002"}


def test_a_stop_that_reached_no_rank_leaves_a_finished_fixed_run_alone(spark, tmp_path):
    """Every rank had returned (the status store lags the tasks' end): no error, no cancel."""
    watch, stops, _, cancels = _watch(tmp_path, grace=0.1)
    for sock in list(stops._ranks):
        stops.rank_gone(sock)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: stops.request is not None, what="the stop request")
    assert watch.error is None and cancels == []


def test_the_owners_stop_stands_over_a_decommission(spark, tmp_path):
    """A timeout came first: the decommission neither replaces nor withdraws it, and the elastic
    run's node is not made to leave (the owner's hard stop ends the run)."""
    left: list[dict[str, str]] = []
    watch, stops, lines, _ = _watch(tmp_path, grace=0.1, leave=left.append)
    assert stops.stop("timeout", 30.0, from_stopper=True)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: any("owner is stopping it already" in line for line in lines), what="the line")
        time.sleep(0.4)
    assert stops.request == StopRequest("timeout", 30.0) and left == [] and spark.killed == []


def test_an_owners_stop_during_a_decommission_is_kept_and_the_node_is_not_replaced(spark, tmp_path):
    left: list[dict[str, str]] = []
    watch, stops, lines, _ = _watch(tmp_path, grace=0.3, leave=left.append)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: stops.request is not None, what="the decommission's stop")
        assert stops.stop("timeout", 30.0, from_stopper=True) is False  # the ranks stop already
        wait_until(lambda: any("is not replaced" in line for line in lines), what="the owner's stop to stand")
    assert stops.withdraw() is False and stops.request is not None and left == []


def test_a_second_decommission_in_the_first_ones_grace_leaves_with_it(spark, tmp_path):
    spark.tasks.append((13, 2, "10.0.0.13", "RUNNING", "3"))
    left: list[dict[str, str]] = []
    watch, stops, _, _ = _watch(tmp_path, grace=0.4, leave=left.append)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: stops.request is not None, what="the first stop")
        spark.decommissioning = ["2", "3"]
        wait_until(lambda: left, what="the nodes to leave")
    assert sorted(task for task, _ in spark.killed) == [12, 13]
    assert left == [{"10.0.0.12:40002": "10.0.0.12", "10.0.0.13:40003": "10.0.0.13"}]


def test_a_fixed_run_whose_ranks_return_within_the_grace_period_is_not_cancelled(spark, tmp_path):
    watch, stops, _, cancels = _watch(tmp_path, grace=0.5)
    with watch:
        spark.decommissioning = ["1"]
        wait_until(lambda: stops.request is not None, what="the stop request")
    # The stage ended (the context exits) before the grace period was out.
    time.sleep(0.7)
    assert cancels == [] and watch.error is not None


def test_when_no_rank_watches_for_stops_a_fixed_run_is_cancelled_at_once(spark, tmp_path):
    watch, stops, _, cancels = _watch(tmp_path, grace=60.0)
    with watch:
        spark.decommissioning = ["1"]
        wait_until(lambda: stops.request is not None, what="the stop request")
        stops.declined.set()
        wait_until(lambda: cancels, what="the cancel", timeout=5)


def test_an_executor_running_none_of_the_runs_nodes_stops_nothing(spark, tmp_path):
    spark.tasks = [(11, 0, "10.0.0.11", "RUNNING", "1"), (9, 1, "10.0.0.13", "FAILED", "3")]
    watch, stops, _, _ = _watch(tmp_path)
    spark.decommissioning = ["3", "7"]
    assert watch.poll() is False
    assert stops.request is None and watch.error is None
    assert watch.poll() is False  # each executor is looked at once


def test_an_elastic_runs_decommissioned_node_leaves_after_the_grace_period(spark, tmp_path):
    left: list[dict[str, str]] = []
    watch, stops, lines, cancels = _watch(tmp_path, grace=0.2, leave=left.append)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: left, what="the node to leave")
    assert spark.killed and spark.killed[0][0] == 12 and spark.killed[0][1].startswith(DECOMMISSIONED)
    assert left == [{"10.0.0.12:40002": "10.0.0.12"}]
    # ... once its task had ended (Spark said so): its agent cannot join the others' next round.
    assert (12, 1, "10.0.0.12", "KILLED", "2") in spark.tasks
    # The group that meets again trains on: the request is withdrawn, no error, no cancel.
    assert stops.request is None and watch.error is None and cancels == []
    assert any("then that node leaves and the others restart from the checkpoint" in line for line in lines)


def test_the_others_restart_only_once_the_decommissioned_nodes_task_has_ended(spark, tmp_path, monkeypatch):
    monkeypatch.setattr(decommission, "kill_task_attempt", lambda sc, task, reason: True)  # slow to end
    left: list[dict[str, str]] = []
    watch, stops, _, _ = _watch(tmp_path, grace=0.0, leave=left.append)
    with watch:
        spark.decommissioning = ["2"]
        wait_until(lambda: stops.request is not None, what="the stop request")
        time.sleep(0.5)
        assert left == []
        spark.tasks = [t if t[0] != 12 else (*t[:3], "KILLED", t[4]) for t in spark.tasks]
        wait_until(lambda: left, what="the node to leave once its task ended")


def test_a_read_that_races_the_scheduler_is_retried_at_the_next_poll(spark, tmp_path, monkeypatch):
    reads = []

    def flaky(sc: object) -> list[str]:
        reads.append(1)
        if len(reads) == 1:
            raise RuntimeError("py4j: ConcurrentModificationException")
        return ["2"]

    monkeypatch.setattr(decommission, "decommissioning_executors", flaky)
    watch, stops, _, _ = _watch(tmp_path)
    with watch:
        wait_until(lambda: stops.request is not None, what="the stop after the failed read")
