"""The trained model as an asset: with ``outlets``, a succeeded run's summary goes into the asset
event's ``extra`` (``context["outlet_events"][asset].extra``), small and plain JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch
from airflow.sdk import Asset, AssetAlias
from airflow.sdk.execution_time.context import OutletEventAccessors

from airflow_provider_torchdist.operators.outlet_events import (
    MAX_METRICS,
    final_metrics,
    run_extra,
    set_outlet_extra,
)
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.outputs.results import load_output
from airflow_provider_torchdist.supervision.lifeline import RunStatus
from tests.unit.conftest import FakeTI

MODEL = Asset("torchdist://models/retrain")
OUTPUT = {"format": "cloudpickle", "type": "dict", "size": 1234, "sha256": "0" * 64}


def _tensor(n):
    return torch.arange(n, dtype=torch.float32)


def test_final_metrics_are_rank_zeros_last_values_without_the_record_fields():
    history = [
        {"rank": 0, "step": 9, "time": 1.0, "total_steps": 10, "loss": 0.1, "acc": 0.9},
        {"rank": 1, "step": 9, "time": 1.1, "loss": 0.2},  # all_ranks=True: rank 0's is the one
    ]
    assert final_metrics(history) == ({"loss": 0.1, "acc": 0.9}, 9)
    assert final_metrics([{"rank": 2, "step": None, "loss": 0.3}]) == ({"loss": 0.3}, None)
    assert final_metrics([]) == ({}, None)
    # The ranks' step times, which a supervised run's history ends with, are not the last report.
    summary = {"rank": 0, "time": 2.0, "summary": "step_time", "mean_step_time_s": 0.2, "compute_share": 0.5}
    assert final_metrics([*history, summary]) == ({"loss": 0.1, "acc": 0.9}, 9)


def test_the_extra_is_small_plain_json():
    record = {"rank": 0, "step": 1, "loss": math.nan, "grad": math.inf}
    record |= {f"m{i}": i for i in range(MAX_METRICS * 2)}
    status = RunStatus(state="succeeded", metrics=[record], output=OUTPUT, elapsed_s=41.7)
    extra = run_extra(status, {"plain": "json"}, world_size=4)
    assert extra["metrics"]["loss"] is None and extra["metrics"]["grad"] is None  # no NaN in JSON
    assert len(extra["metrics"]) == MAX_METRICS
    assert (extra["world_size"], extra["duration_s"], extra["step"]) == (4, 41.7, 1)
    assert (extra["output_type"], extra["output_format"], extra["output_size"]) == (
        "dict",
        "cloudpickle",
        1234,
    )
    assert "output_ref" not in extra  # inline in XCom: nothing stored elsewhere
    assert json.loads(json.dumps(extra, allow_nan=False)) == extra
    assert len(json.dumps(extra)) < 2000


def test_a_script_has_no_output_fields():
    extra = run_extra(RunStatus(state="succeeded", elapsed_s=3.0), None, world_size=2)
    assert extra == {"metrics": {}, "step": None, "world_size": 2, "duration_s": 3.0}


def test_set_outlet_extra_fills_every_asset_and_keeps_what_was_there():
    other = Asset("s3://bucket/models/other")
    events = OutletEventAccessors()
    events[other].extra["owner"] = "ml-team"  # set by the task's own code, kept
    set_outlet_extra({"outlet_events": events}, [MODEL, other, AssetAlias("models")], {"world_size": 2})
    assert events[MODEL].extra == {"world_size": 2}
    assert events[other].extra == {"owner": "ml-team", "world_size": 2}
    set_outlet_extra({}, [MODEL], {"world_size": 2})  # no outlet events in the context: nothing to do


@pytest.mark.usefixtures("faked_spark")
def test_a_succeeded_run_describes_the_model_in_its_asset_event(tmp_path):
    op = TorchDistributorOperator(
        task_id="train",
        train_object=_tensor,
        args=[100_000],
        num_processes=2,
        max_xcom_output_bytes=1024,  # over it: stored at output_path, XCom holds a reference
        output_path=f"file://{tmp_path}/outputs",
        outlets=[MODEL],
    )
    context = {"ti": FakeTI(), "outlet_events": OutletEventAccessors()}
    value = op.execute(context)
    extra = context["outlet_events"][MODEL].extra
    assert extra["metrics"] == {"loss": 1.0} and extra["step"] == 0  # faked_spark's one report
    assert (extra["output_type"], extra["output_format"]) == ("torch.Tensor", "cloudpickle")
    assert extra["output_size"] > 400_000
    assert extra["output_ref"] == value["ref"] and extra["output_ref"].startswith(
        f"file://{tmp_path}/outputs/"
    )
    assert extra["world_size"] == 2
    assert 0 <= extra["duration_s"] < 60
    assert torch.equal(load_output(value), _tensor(100_000))


@pytest.mark.usefixtures("faked_spark")
def test_without_outlets_no_extra_is_set():
    context = {"ti": FakeTI(), "outlet_events": OutletEventAccessors()}
    TorchDistributorOperator(task_id="train", train_object=_tensor, args=[3]).execute(context)
    assert len(context["outlet_events"]) == 0


def test_a_failed_run_sets_no_extra(faked_spark):
    from airflow_provider_torchdist.errors import TrainingFailed
    from airflow_provider_torchdist.spark.wire.outcome import Outcome, RankFailure

    faked_spark.outcome = Outcome(
        ok=False, failures=[RankFailure(rank=0, exc_type="RuntimeError", message="x")]
    )
    context = {"ti": FakeTI(), "outlet_events": OutletEventAccessors()}
    op = TorchDistributorOperator(task_id="train", train_object=_tensor, args=[3], outlets=[MODEL])
    with pytest.raises(TrainingFailed):
        op.execute(context)
    assert len(context["outlet_events"]) == 0
