"""``train_data_args``: values for a ``train_data`` query's ``:name`` parameters, from the DAG to the
driver's ``spark.sql(query, args=...)``.

The values are templated and checked like every setting, and travel in the job spec's JSON; the
real binding by Spark, with an injection string that stays a literal, is shown in
``tests/integration/test_train_data.py::test_a_script_reads_its_shard_with_rank_shard``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.submit.checks import build_spec, check_settings

QUERY = "SELECT id FROM parquet.`/data/events` WHERE day = :day AND kind = :kind"


def _train() -> None:
    """Never run: these tests stop at the spec."""


def test_templated_values_render_into_the_spec_and_the_query_text_stays_as_written() -> None:
    op = TorchDistributorOperator(
        task_id="t",
        train_object=_train,
        train_data=QUERY,
        train_data_args={"day": "{{ ds }}", "kind": "{{ params.kind }}", "limit": 5},
    )
    assert "train_data_args" in op.template_fields
    hostile = "x' OR '1'='1"
    op.render_template_fields({"ds": "2024-05-01", "params": {"kind": hostile}})

    spec = op.training_spec()

    assert spec.train_data == QUERY  # the conf's value never reaches the query's text
    assert spec.train_data_args == {"day": "2024-05-01", "kind": hostile, "limit": 5}
    job = JobSpec.from_json(
        JobSpec.for_run(spec, kind="callable", entry="p", run_id="r", token="t").to_json()
    )
    assert job.train_data_args == spec.train_data_args  # what the driver binds


def test_literal_values_of_every_kind_spark_binds_are_taken() -> None:
    args = {"s": "a", "i": 3, "f": 0.5, "b": True, "n": None}
    assert build_spec(train_data=QUERY, train_data_args=args).train_data_args == args
    assert build_spec().train_data_args == {}


@pytest.mark.parametrize(
    "train_data, args, message",
    [
        pytest.param(QUERY, ["2024-05-01"], r"train_data_args must be a dict, got list", id="not-a-dict"),
        pytest.param(
            QUERY, {"day-1": "x"}, r"train_data_args keys must be parameter names.*'day-1'", id="bad-name"
        ),
        pytest.param(
            QUERY,
            {"day": Path("/x"), "kind": [1]},
            r"values must be strings, numbers, booleans or None.*day=PosixPath, kind=list.*DATE\(:day\)",
            id="not-a-literal",
        ),
        pytest.param("db.events", {"day": "x"}, r"but train_data is the table name 'db.events'", id="table"),
        pytest.param(None, {"day": "x"}, r"but train_data is not set", id="no-train_data"),
        pytest.param(lambda spark: None, {"day": "x"}, r"but train_data is a callable", id="callable"),
    ],
)
def test_what_spark_could_not_bind_is_refused_when_the_dag_is_parsed(train_data, args, message) -> None:
    with pytest.raises(InvalidTrainingConfig, match=message):
        TorchDistributorOperator(
            task_id="t", train_object=_train, train_data=train_data, train_data_args=args
        )


def test_a_templated_query_or_value_is_checked_after_rendering() -> None:
    settings = {"train_data": "{{ params.q }}", "train_data_args": {"day": "{{ ds }}"}}
    assert check_settings(settings, at_parse_time=True)["train_data_args"] == {"day": "{{ ds }}"}
    with pytest.raises(InvalidTrainingConfig, match="train_data is the table name 'events'"):
        check_settings({"train_data": "events", "train_data_args": {"day": "x"}}, at_parse_time=False)
