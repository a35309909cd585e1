"""``report()``: the record it sends, ``total_steps`` as a field rather than a metric, and the log line."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from airflow_provider_torchdist import report
from airflow_provider_torchdist.spark.node import rank_context
from airflow_provider_torchdist.spark.node.metrics import RECORD_FIELDS, format_metrics
from airflow_provider_torchdist.spark.wire.protocol import Metric, decode, encode


def test_a_record_carries_total_steps_after_its_own_fields(sent_metrics: list[dict[str, Any]]) -> None:
    report(step=3, total_steps=10, loss=torch.tensor(0.25), lr=0.01)
    (record,) = sent_metrics
    assert list(record) == ["rank", "step", "time", "total_steps", "loss", "lr"]
    assert record["total_steps"] == 10 and record["loss"] == 0.25
    assert format_metrics(record) == "rank 0 step 3/10: loss=0.25 lr=0.01"


def test_without_total_steps_the_record_has_no_such_field(sent_metrics: list[dict[str, Any]]) -> None:
    report(step=3, loss=0.5)
    (record,) = sent_metrics
    assert "total_steps" not in record
    assert format_metrics(record) == "rank 0 step 3: loss=0.5"


@pytest.mark.parametrize("total", [np.int64(7), torch.tensor(7)])
def test_an_integer_scalar_is_a_total_and_arrives_as_int(
    sent_metrics: list[dict[str, Any]], total: Any
) -> None:
    report(step=1, total_steps=total, loss=1.0)
    assert type(sent_metrics[0]["total_steps"]) is int and sent_metrics[0]["total_steps"] == 7


@pytest.mark.parametrize(
    ("total", "error", "match"),
    [
        (True, TypeError, "must be a positive int.*got bool True"),
        (10.0, TypeError, "must be a positive int.*got float 10.0"),
        ("10", TypeError, "must be a positive int.*got str '10'"),
        (0, ValueError, "must be a positive int.*got 0"),
        (-5, ValueError, "must be a positive int.*got -5"),
    ],
)
def test_a_bad_total_is_refused_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, total: Any, error: type[Exception], match: str
) -> None:
    monkeypatch.setenv("RANK", "1")  # a rank whose reports are dropped still hears of the mistake
    with pytest.raises(error, match=match):
        report(step=1, total_steps=total, loss=1.0)


@pytest.mark.parametrize("name", ["rank", "time"])
def test_a_record_field_cannot_be_a_metric_name(sent_metrics: list[dict[str, Any]], name: str) -> None:
    with pytest.raises(ValueError, match=f"'{name}' cannot be a metric name: rank, step, time, total_steps"):
        report(step=1, **{name: 1.0})
    assert sent_metrics == []


def test_other_ranks_report_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, sent_metrics: list[dict[str, Any]]
) -> None:
    monkeypatch.setenv("RANK", "1")
    report(step=1, total_steps=2, loss=1.0)
    report(step=1, total_steps=2, all_ranks=True, loss=1.0)
    assert [(r["rank"], r["total_steps"]) for r in sent_metrics] == [(1, 2)]


def test_without_a_driver_the_report_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    rank_context.set_client(None)
    report(step=2, total_steps=4, loss=0.5)
    assert capsys.readouterr().out == "[metrics] rank 0 step 2/4: loss=0.5\n"


def test_total_steps_survives_the_wire() -> None:
    record = {"rank": 0, "step": 3, "time": 1.0, "total_steps": 10, "loss": 0.5}
    assert decode(encode(Metric(record))) == Metric(record)


def test_the_record_fields_are_never_shown_as_metrics() -> None:
    record = {"rank": 0, "step": None, "time": 1.0, "total_steps": 10, "loss": 0.5}
    assert format_metrics(record) == "rank 0: loss=0.5"  # a total without a step says nothing
    assert set(RECORD_FIELDS) == {"rank", "step", "time", "total_steps"}
