"""TaskTracking's share of the follow loop: each report offered once, what an earlier try logged
skipped, the final status and metrics at the end (a recording stand-in for MlflowClient: the real
server's answers are tests/integration/test_mlflow_tracking.py's)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchdist.operators.tracking.task_run import TaskTracking


class RecordingClient:
    def __init__(self) -> None:
        self.metrics: list[Any] = []
        self.tags: list[Any] = []
        self.ended: list[str] = []

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        self.metrics += list(metrics)
        self.tags += list(tags)

    def set_terminated(self, run_id: str, status: str) -> None:
        self.ended.append(status)


def test_each_report_is_logged_once_and_an_earlier_trys_are_skipped() -> None:
    client = RecordingClient()
    tracking = TaskTracking(client, "run-1", "", logged_until=102.0, describe="test run")
    history = [{"rank": 0, "step": s, "time": 100.0 + s, "loss": 1.0} for s in range(5)]
    tracking.follow_metrics(history[:3])  # steps 0-2: logged by the earlier try (times <= 102)
    tracking.follow_metrics(history[:4])
    tracking.follow_metrics(history)
    tracking.follow_metrics(list(history))  # the run's final status: the same records again
    tracking.finish(True, {"loss": 0.5, "duration_s": 3.0})
    steps = sorted(m.step for m in client.metrics if m.key == "loss")
    assert steps == [3, 4]
    assert {m.key for m in client.metrics} == {"loss", "final/loss", "duration_s"}
    assert client.ended == ["FINISHED"]
    assert client.tags[-1].key == "torchdist.metrics_logged_until" and float(client.tags[-1].value) == 104.0


def test_reports_made_in_the_same_millisecond_are_each_logged() -> None:
    """report() times have a clock's resolution: steps reported back to back share one (this lost
    steps 2, 4, 5, 7 and 8 of test_mlflow_tracking's outage run before)."""
    client = RecordingClient()
    tracking = TaskTracking(client, "run-1", "", logged_until=0.0, describe="test run")
    history: list[dict] = []
    for step in range(6):
        history.append({"rank": 0, "step": step, "time": 100.0 + step // 3, "loss": 1.0})
        tracking.follow_metrics(history)
    tracking.finish(True, {})
    assert sorted(m.step for m in client.metrics if m.key == "loss") == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("uri", "url"),
    [
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000/#/experiments/3/runs/abc"),
        ("https://mlflow.example/ml/", "https://mlflow.example/ml/#/experiments/3/runs/abc"),
        (
            "https://user:s3cret@mlflow.example:8443/ml",
            "https://mlflow.example:8443/ml/#/experiments/3/runs/abc",
        ),
        ("https://token@mlflow.example", "https://mlflow.example/#/experiments/3/runs/abc"),
        ("databricks", ""),
        ("file:///tmp/mlruns", ""),
        ("http://", ""),
    ],
)
def test_the_run_url_never_carries_the_tracking_uris_credentials(uri: str, url: str) -> None:
    from airflow_provider_torchdist.operators.tracking.runs import run_url

    assert run_url(uri, "3", "abc") == url
