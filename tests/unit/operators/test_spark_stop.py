"""The operator and Spark's stop: a succeeded run is handed over with the driver's outcome, while
Spark stops; a task in a pod of its own (``KubernetesExecutor``) waits for that stop, which the
pod's end would cut short. spark-submit is played in-process (``faked_spark``); the supervisor,
its lifeline and the owner's handshake are real."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from tests.unit.conftest import FakeTI


def _double(x: int) -> int:
    return 2 * x


def _op(**kwargs) -> TorchDistributorOperator:
    return TorchDistributorOperator(
        task_id="train", train_object=_double, args=[21], num_processes=2, deferrable=False, **kwargs
    )


def test_the_task_gets_its_value_while_spark_still_stops(faked_spark, inline_supervisor, monkeypatch):
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    returned = threading.Event()
    seen: list[bool] = []

    def stopping(staging: Path) -> None:  # Spark's stop goes on until the task has its value
        seen.append(returned.wait(10))

    faked_spark.stopping = stopping
    assert _op().execute({"ti": FakeTI()}) == 42
    returned.set()
    supervisor = inline_supervisor[0]
    deadline = time.monotonic() + 10
    while supervisor.staging_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen == [True]  # the stop was still going on when execute returned
    assert not supervisor.staging_dir.exists()  # then the supervisor tore the run down


def test_a_task_in_a_pod_of_its_own_returns_only_once_spark_has_stopped(
    faked_spark, inline_supervisor, monkeypatch
):
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "KubernetesExecutor")
    stopped = threading.Event()

    def stopping(staging: Path) -> None:
        time.sleep(0.3)
        stopped.set()

    faked_spark.stopping = stopping
    assert _op().execute({"ti": FakeTI()}) == 42
    assert stopped.is_set()
    assert not inline_supervisor[0].staging_dir.exists()  # torn down before execute returned


@pytest.mark.parametrize(
    "executor",
    [
        "KubernetesExecutor",
        "KubernetesExecutor,CeleryExecutor",  # the first is the default
        "airflow.providers.amazon.aws.executors.ecs.ecs_executor.AwsEcsExecutor",
        "k8s:airflow.providers.cncf.kubernetes.executors.kubernetes_executor.KubernetesExecutor",
    ],
)
def test_deferral_is_refused_in_a_pod_of_its_own(no_submit, monkeypatch, executor):
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", executor)
    op = TorchDistributorOperator(task_id="train", train_object=_double, args=[21], deferrable=True)
    with pytest.raises(InvalidTrainingConfig, match="deferrable=True cannot work on .*Executor"):
        op.execute({"ti": FakeTI()})
    assert no_submit == []


@pytest.mark.parametrize(
    "setting, own, bound",
    [
        ("CeleryExecutor,KubernetesExecutor", None, False),  # the default runs it
        ("CeleryExecutor,KubernetesExecutor", "KubernetesExecutor", True),  # the task's own
        ("KubernetesExecutor", "CeleryExecutor", False),
        ("LocalExecutor", None, False),
    ],
)
def test_the_executor_is_the_tasks_own_else_the_default(monkeypatch, setting, own, bound):
    from airflow_provider_torchdist.operators.executors import pod_bound, task_executor

    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", setting)
    ti = FakeTI()
    ti.executor = own
    assert pod_bound(task_executor(ti)) is bound
