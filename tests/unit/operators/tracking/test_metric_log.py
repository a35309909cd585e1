"""MetricLog: metrics leave the follow loop at once, survive an outage in a bounded buffer, and
what could not be logged is said in the task log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest

from airflow_provider_torchdist.operators.tracking.metric_log import MetricLog, MetricValue, metric_values


class FlakyServer:
    """A tracking endpoint the test takes down and brings back: ``send`` raises while it is down,
    and blocks while it is ``slow`` (a server that does not answer)."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.up.set()
        self.answering = threading.Event()
        self.answering.set()
        self.received: list[MetricValue] = []
        self.failures = threading.Event()

    def send(self, batch: Sequence[MetricValue]) -> None:
        self.answering.wait()
        if not self.up.is_set():
            self.failures.set()
            raise ConnectionRefusedError("connection refused")
        self.received.extend(batch)


def record(step: int, rank: int = 0, **values: float) -> dict:
    return {"rank": rank, "step": step, "time": 1000.0 + step, **(values or {"loss": 1.0 / (step + 1)})}


def test_a_records_values_are_its_metrics_at_its_step_and_time_other_ranks_suffixed() -> None:
    values = metric_values({"rank": 1, "step": 3, "time": 2.5, "total_steps": 9, "loss": 0.5, "ok": True})
    assert values == [MetricValue("loss/rank1", 0.5, 2500, 3)]
    assert [v.key for v in metric_values(record(0, lr=0.1, loss=2.0))] == ["lr", "loss"]


def test_offer_returns_while_the_server_does_not_answer() -> None:
    server = FlakyServer()
    server.answering.clear()  # every send blocks, as against a server that hangs
    metrics = MetricLog(server.send, flush_timeout=0.1)
    for step in range(1000):
        metrics.offer(record(step))  # would hang here if offer sent anything itself
    assert metrics.pending >= 999
    server.answering.set()
    assert metrics.flush(30)
    assert [v.step for v in server.received] == list(range(1000))
    metrics.close()


def test_metrics_buffered_in_an_outage_are_logged_in_order_when_the_server_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FlakyServer()
    metrics = MetricLog(server.send, backoff=(0.01, 0.05))
    metrics.offer(record(0))
    assert metrics.flush(30)
    server.up.clear()
    with caplog.at_level(logging.INFO, logger="airflow_provider_torchdist.operators.tracking.metric_log"):
        for step in range(1, 6):
            metrics.offer(record(step))
        assert server.failures.wait(30)
        assert metrics.pending == 5
        server.up.set()
        assert metrics.flush(30)
        assert metrics.close() == 0
    assert [v.step for v in server.received] == [0, 1, 2, 3, 4, 5]
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not log metrics" in m and "Training goes on" in m for m in messages), messages
    assert any("answers again" in m for m in messages), messages


def test_a_full_buffer_drops_the_oldest_and_close_says_what_was_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FlakyServer()
    server.up.clear()
    metrics = MetricLog(server.send, capacity=3, flush_timeout=0.2, backoff=(0.01, 0.05))
    for step in range(10):
        metrics.offer(record(step))
    with caplog.at_level(logging.WARNING, logger="airflow_provider_torchdist.operators.tracking.metric_log"):
        lost = metrics.close()
    assert lost == 10 and metrics.dropped == 7
    assert server.received == []
    assert any("10 metric value(s) could not be logged" in r.getMessage() for r in caplog.records)
    metrics.offer(record(11))  # after close: ignored, never raised
    assert metrics.pending == 0


def test_reports_in_quick_succession_go_in_one_request_per_interval_and_a_full_batch_at_once() -> None:
    """A run that reports every few milliseconds must not cost the server a request a report."""
    server = FlakyServer()
    requests: list[int] = []

    def send(batch: Sequence[MetricValue]) -> None:
        requests.append(len(batch))
        server.send(batch)

    metrics = MetricLog(send, interval=3600.0)  # the next send waits for the interval, or a batch
    metrics.offer(record(0))
    while not requests:  # the first value goes at once: nothing was sent before it
        threading.Event().wait(0.01)
    for step in range(1, 200):
        metrics.offer(record(step))
    assert requests == [1]  # 199 values wait for the interval...
    for step in range(200, 1200):
        metrics.offer(record(step))
    while len(requests) < 2:  # ...until they fill a batch, which goes at once
        threading.Event().wait(0.01)
    assert requests[1] == 1000
    assert metrics.flush(10)  # a flush does not wait for the interval either
    assert requests == [1, 1000, 199] and [v.step for v in server.received] == list(range(1200))
    metrics.close()
