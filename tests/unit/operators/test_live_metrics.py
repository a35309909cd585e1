"""The metric history while a run trains: the hook hears each report, the operator pushes the
growing history to XCom ``metrics`` at most once a second (a fake clock and fake timers here), and
the final push at the end holds the whole history."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.operators.xcom import (
    METRICS_XCOM_KEY,
    WORLD_SIZES_XCOM_KEY,
    ThrottledPush,
    metrics_pusher,
)
from airflow_provider_torchdist.supervision.lifeline import DoneEvent, LineEvent, MetricEvent, RunStatus
from airflow_provider_torchdist.supervision.lifeline.messages import METRICS_BUDGET_BYTES
from airflow_provider_torchdist.supervision.record import RunRecord
from tests.unit.conftest import wait_until

RECORD = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)


def reports(n: int) -> list[dict[str, Any]]:
    return [{"rank": 0, "step": step, "time": 1.0 + step, "loss": 1.0 / (step + 1)} for step in range(n)]


class FakeTimer:
    def __init__(self, delay: float, action: Any) -> None:
        self.delay, self.action, self.cancelled = delay, action, False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.action()


class Clock:
    """A fake monotonic clock and timer scheduler: time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.now

    def schedule(self, delay: float, action: Any) -> FakeTimer:
        self.timers.append(FakeTimer(delay, action))
        return self.timers[-1]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def throttled(clock: Clock, pushed: list[Any], interval: float = 1.0) -> ThrottledPush:
    return ThrottledPush(
        lambda value: pushed.append(list(value)), interval, clock=clock, schedule=clock.schedule
    )


# -- the throttle ---------------------------------------------------------------------------------


def test_the_first_report_goes_at_once_then_at_most_one_push_a_second(clock):
    pushed: list[Any] = []
    push = throttled(clock, pushed)
    history = reports(5)
    push.offer(history[:1])
    assert pushed == [history[:1]] and clock.timers == []
    clock.now = 0.3
    push.offer(history[:2])
    clock.now = 0.6
    push.offer(history[:3])
    # Held back, with one timer for the rest of the interval.
    assert pushed == [history[:1]]
    [timer] = clock.timers
    assert timer.delay == pytest.approx(0.7)
    clock.now = 1.0
    timer.fire()  # the newest held history goes, without waiting for another report
    assert pushed == [history[:1], history[:3]]
    clock.now = 1.5
    push.offer(history[:4])
    assert len(pushed) == 2 and clock.timers[-1].delay == pytest.approx(0.5)
    clock.now = 2.6  # the timer is late (a busy machine): the next report goes at once anyway
    push.offer(history[:5])
    assert pushed[-1] == history[:5]
    clock.timers[-1].fire()  # nothing new held: no push
    assert len(pushed) == 3


def test_reports_further_apart_than_the_interval_each_go_at_once(clock):
    pushed: list[Any] = []
    push = throttled(clock, pushed)
    for step in range(4):
        clock.now = 1.5 * step
        push.offer(reports(step + 1))
    assert [len(p) for p in pushed] == [1, 2, 3, 4]
    assert clock.timers == []


def test_close_cancels_the_timer_and_pushes_the_final_history_last(clock):
    pushed: list[Any] = []
    push = throttled(clock, pushed)
    push.offer(reports(1))
    clock.now = 0.2
    push.offer(reports(2))
    push.close(reports(7))  # the run's final history, from its final status
    [timer] = clock.timers
    assert timer.cancelled
    timer.action()  # a timer thread already past its cancel check still pushes nothing
    push.offer(reports(8))  # nor does a report heard after the end
    assert pushed == [reports(1), reports(7)]


def test_close_with_nothing_pushes_nothing(clock):
    pushed: list[Any] = []
    throttled(clock, pushed).close(None)
    assert pushed == []


def test_a_failing_live_push_is_logged_and_the_run_goes_on_but_the_final_push_raises(clock, caplog):
    def push(value: Any) -> None:
        raise ConnectionError("the API server is restarting")

    throttle = ThrottledPush(push, clock=clock, schedule=clock.schedule)
    with caplog.at_level(logging.WARNING):
        throttle.offer(reports(1))
    assert "the API server is restarting" in caplog.text
    with pytest.raises(ConnectionError):
        throttle.close(reports(2))


def test_the_default_timer_pushes_what_was_held_back():
    pushed: list[Any] = []
    push = ThrottledPush(lambda value: pushed.append(list(value)), interval=0.05)
    push.offer(reports(1))
    push.offer(reports(2))
    assert pushed == [reports(1)]
    wait_until(lambda: len(pushed) == 2, timeout=5, what="the timer's push")
    assert pushed[-1] == reports(2)


# -- to XCom --------------------------------------------------------------------------------------


class RecordingTI:
    """A task instance that records every XCom push, in order."""

    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "train", -1, 1
    stats_tags: dict = {}  # noqa: RUF012 (read by ResumableJobMixin)

    def __init__(self) -> None:
        self.pushes: list[tuple[str, Any]] = []

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushes.append((key, value))


def test_metrics_pusher_pushes_a_snapshot_of_the_newest_records_that_fit(clock):
    ti = RecordingTI()
    push = metrics_pusher(ti, clock=clock, schedule=clock.schedule)
    history = reports(2)
    push.offer(history)
    history.append({"rank": 0, "step": 2, "loss": 0.1})  # the hook's list grows on
    assert ti.pushes == [(METRICS_XCOM_KEY, reports(2))]
    big = [{"rank": 0, "step": step, "note": "x" * 1000} for step in range(1000)]
    push.close(big)
    key, final = ti.pushes[-1]
    assert final[-1]["step"] == 999 and len(final) < 1000  # as the run's final status keeps them
    assert sum(len(str(r)) for r in final) <= METRICS_BUDGET_BYTES * 1.1


# -- the hook hears each report ---------------------------------------------------------------------


class FakeOwner:
    """An owner lifeline: the run's status when it connected, then its events."""

    def __init__(self, status: RunStatus, events: list[Any]) -> None:
        self.status, self._events, self.released, self.closed = status, events, False, False

    def events(self) -> Any:
        yield from self._events

    def fetch_output(self, dest: Path) -> Path | None:
        return None

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


def test_follow_tells_on_metrics_the_history_as_it_grows_from_what_the_run_had_before():
    history = reports(3)
    final = RunStatus(state="succeeded", metrics=history, elapsed_s=12.5)
    owner = FakeOwner(
        RunStatus(state="running", metrics=history[:1]),  # reattached: one report came before
        [MetricEvent(history[1]), LineEvent(4, "[metrics] ..."), MetricEvent(history[2]), DoneEvent(final)],
    )
    hook = TorchDistributorHook()
    hook._owner, hook.record = owner, RECORD
    heard: list[list[dict[str, Any]]] = []
    hook.on_metrics = lambda metrics: heard.append(list(metrics))
    assert hook.follow(RECORD, lambda path: "value") == "value"
    assert heard == [history[:1], history[:2], history[:3]]  # a reattached owner hears the past at once
    assert hook.metrics == history and hook.run_status == final
    assert owner.released and owner.closed


def test_an_owner_of_an_ended_run_hears_nothing_before_the_end():
    """execute_complete after a deferral: the final history is pushed once, at the end."""
    final = RunStatus(state="succeeded", metrics=reports(2))
    hook = TorchDistributorHook()
    hook._owner, hook.record = FakeOwner(final, [DoneEvent(final)]), RECORD
    heard: list[Any] = []
    hook.on_metrics = heard.append
    hook.follow(RECORD, lambda path: None)
    assert heard == [] and hook.metrics == reports(2)


def test_the_operator_pushes_the_first_report_at_once_and_the_whole_history_at_the_end():
    history = reports(3)
    op = TorchDistributorOperator(task_id="train", train_object=lambda: None)

    def follow(record: RunRecord, handle: Any, **options: Any) -> str:
        for n in (1, 2, 3):  # three reports within a second: the first goes, the others wait
            hook.metrics = history[:n]
            hook.on_metrics(hook.metrics)
        return "value"

    hook = SimpleNamespace(
        follow=follow, metrics=[], spec=op.training_spec(), run_status=None, world_sizes=[]
    )
    op._hook = hook
    ti = RecordingTI()
    assert op._follow(RECORD, {"ti": ti}, ended=False) == "value"
    assert ti.pushes == [
        (METRICS_XCOM_KEY, history[:1]),
        (METRICS_XCOM_KEY, history),
        (WORLD_SIZES_XCOM_KEY, []),  # a succeeded run's, after its metrics
    ]


def test_airflows_own_timeout_during_the_follow_stops_the_run_and_follows_the_stop_to_its_end(monkeypatch):
    """Airflow's execution_timeout raises inside the follow at the moment the run's deadline stops it:
    the hook tells the run "stop" and reads on until its final status, so that the task log says how
    the stop went; then the timeout stands."""
    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    class TimedOutOwner(FakeOwner):
        def __init__(self) -> None:
            stopped = RunStatus(state="failed", error="stopped by its owner (timeout); the ranks ended ...")
            super().__init__(
                RunStatus(state="running"),
                [LineEvent(5, "[torchdist] the run ended 1.2 s after the stop request"), DoneEvent(stopped)],
            )
            self.stops: list[str | None] = []
            self.reads = 0

        def events(self) -> Any:
            self.reads += 1
            if self.reads == 1:
                raise AirflowTaskTimeout("Timeout, PID: 1")  # what Airflow's SIGALRM handler raises
            yield from self._events

        def stop(self, why: str | None = None) -> None:
            self.stops.append(why)

    owner = TimedOutOwner()
    hook = TorchDistributorHook()
    hook._owner, hook.record = owner, RECORD
    lines: list[str] = []
    log = SimpleNamespace(info=lambda fmt, text: lines.append(text))
    monkeypatch.setattr(TorchDistributorHook, "log", property(lambda self: log))
    with pytest.raises(AirflowTaskTimeout):
        hook.follow(RECORD, lambda path: "value")
    assert owner.stops == ["timeout"]
    assert lines == ["[torchdist] the run ended 1.2 s after the stop request"]
    assert owner.closed and not owner.released  # nothing taken from a stopped run
