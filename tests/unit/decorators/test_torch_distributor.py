"""``@task.torch_distributor``: registered with Airflow, built on its public decorator API, the
decorated function as ``train_object`` and the call's rendered arguments as ``args``/``kwargs``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pendulum
import pytest
from airflow.sdk import DAG, task

from airflow_provider_torchdist import torch_distributor_task
from airflow_provider_torchdist.decorators.torch_distributor import TorchDistributorDecoratedOperator
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.outputs.results import load_output
from tests.unit.conftest import FakeTI

START = pendulum.datetime(2026, 1, 1)


def fit(data_path: str, lr: float = 0.1, epochs: int = 1) -> dict:
    raise AssertionError("building and rendering the task must never call the training function")


def scaled(n: int, scale: float = 1.0) -> dict:
    return {"n": n, "scaled": n * scale}


class PullingTI(FakeTI):
    """A task instance whose upstream tasks pushed ``values`` (task_id -> return value)."""

    def __init__(self, values: dict[str, Any], map_index: int = -1) -> None:
        super().__init__()
        self.values, self.map_index = values, map_index

    def xcom_pull(self, task_ids: str, key: str = "return_value", **_: Any) -> Any:
        return self.values[task_ids]


def test_airflows_task_object_finds_the_decorator() -> None:
    assert task.torch_distributor is torch_distributor_task


def test_the_call_builds_the_operator_with_the_function_as_train_object() -> None:
    with DAG("d", schedule=None, start_date=START) as dag:
        train = task.torch_distributor(num_processes=2, local_mode=True, retries=1)(fit)
        train("/data", lr=0.5)
    op = dag.get_task("fit")
    assert isinstance(op, TorchDistributorDecoratedOperator) and isinstance(op, TorchDistributorOperator)
    assert op.train_object is fit and op.train_script is None
    assert (op.op_args, op.op_kwargs) == (("/data",), {"lr": 0.5})
    assert (op.num_processes, op.local_mode, op.retries, op.multiple_outputs) == (2, True, 1, False)
    assert {"op_args", "op_kwargs", "train_kwargs", "num_processes"} <= set(op.template_fields)


def test_a_dict_return_annotation_still_pushes_one_value() -> None:
    with DAG("d", schedule=None, start_date=START) as dag:
        task.torch_distributor(num_processes=1)(fit)("/data")  # fit is annotated -> dict
    assert dag.get_task("fit").multiple_outputs is False


@pytest.mark.parametrize(
    "decorator_kwargs, call, match",
    [
        ({"num_process": 2}, ("/d",), r"num_process"),  # an operator argument's typo fails the import
        ({"num_processes": 0}, ("/d",), r"num_processes must be an integer >= 1"),
        ({"args": [1]}, ("/d",), r"does not take args.*fit\(1e-3, epochs=3\)"),
        ({"train_object": "t.py"}, ("/d",), r"does not take train_object.*TorchDistributorOperator"),
        ({}, (), r"missing a required argument: 'data_path'"),
    ],
)
def test_mistakes_fail_when_the_dag_is_parsed(decorator_kwargs, call, match) -> None:
    with pytest.raises((InvalidTrainingConfig, TypeError), match=match):
        with DAG("d", schedule=None, start_date=START):
            task.torch_distributor(**decorator_kwargs)(fit)(*call)


def test_multiple_outputs_is_refused() -> None:
    with pytest.raises(InvalidTrainingConfig, match=r"multiple_outputs=True.*one signed envelope"):
        task.torch_distributor(multiple_outputs=True)(fit)


def test_a_context_parameter_it_cannot_fill_is_refused() -> None:
    def train(data_path: str, ti):  # a plain @task would fill ti; the ranks have no task context
        return data_path

    with pytest.raises(InvalidTrainingConfig, match=r"train\(\) has the parameter\(s\) ti.*no task context"):
        with DAG("d", schedule=None, start_date=START):
            task.torch_distributor(num_processes=1)(train)("/d")


def test_upstream_values_are_rendered_into_the_runs_args_and_kwargs() -> None:
    @task
    def prepare() -> str:
        return "/data/v1"

    with DAG("d", schedule=None, start_date=START, params={"lr": 0.25}) as dag:
        task.torch_distributor(num_processes=2)(fit)(prepare(), lr="{{ params.lr }}")
    op = dag.get_task("fit")
    context = {"ti": PullingTI({"prepare": "/data/v1"}), "params": {"lr": 0.25}, "task": op}
    op.render_template_fields(context)
    assert (list(op.op_args), op.op_kwargs) == (["/data/v1"], {"lr": "0.25"})


def _render_mapped(map_index: int) -> Any:
    with DAG("d", schedule=None, start_date=START) as dag:
        task.torch_distributor(
            num_processes=2, local_mode=True, map_index_template="lr={{ task.train_kwargs['lr'] }}"
        )(fit).partial(data_path="/data").expand(lr=[0.1, 0.05])
    mapped = dag.get_task("fit")
    ti = SimpleNamespace(map_index=map_index, task=mapped, run_id="r", dag_id="d", task_id="fit")
    context = {"ti": ti, "task": mapped, "dag": dag, "dag_run": SimpleNamespace(conf={})}
    mapped.render_template_fields(context)
    return context["task"]


def test_a_mapped_call_renders_each_trials_arguments_without_calling_the_function() -> None:
    op = _render_mapped(1)
    assert isinstance(op, TorchDistributorDecoratedOperator)
    assert op.train_object is fit and op.op_kwargs == {"data_path": "/data", "lr": 0.05}
    assert op.training_spec().num_processes == 2


def test_it_serializes_with_the_dag_mapped_or_not() -> None:
    try:
        from airflow.serialization.serialized_objects import DagSerialization
    except ImportError:  # Airflow 3.0
        from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization

    @task
    def prepare() -> str:
        return "/data/v1"

    with DAG("d", schedule=None, start_date=START) as dag:
        train = task.torch_distributor(num_processes=2, deferrable=True, durable=True)(fit)
        train(prepare())
        train.partial(data_path="/d").expand(lr=[0.1, 0.2])
    back = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert list(back.get_task("fit").template_fields) == list(
        TorchDistributorDecoratedOperator.template_fields
    )
    assert back.get_task("fit__1").operator_name == "@task.torch_distributor"


def test_execute_trains_the_function_with_the_rendered_arguments(faked_spark) -> None:
    with DAG("d", schedule=None, start_date=START) as dag:
        task.torch_distributor(num_processes=2)(scaled)(21, scale=2.0)
    op = dag.get_task("scaled")
    ti = FakeTI()
    value = op.execute({"ti": ti})  # what rank 0 returned, in the operator's signed envelope
    assert load_output(value) == {"n": 21, "scaled": 42.0}
    assert (op.train_args, op.train_kwargs) == ([21], {"scale": 2.0})  # map_index_template reads these
    assert ti.pushed["checkpoint_dir"].endswith("/torchdist-checkpoints/d/manual__1/train")
