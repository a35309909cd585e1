"""OpenLineage: the operator gives the Spark application the task's OpenLineage identity through the
OpenLineage provider's helpers, as ``SparkSubmitOperator`` does; off by default, lazy, and harmless
without the provider."""

from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace

import airflow.providers.openlineage.plugins.macros as ol_macros  # noqa: E402  (the [test] extra has it: a broken install fails, not skips)
import pendulum
import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from tests.unit.conftest import plan_without_a_run

OL_HELPERS = "airflow.providers.openlineage.utils.spark"
COMPAT = "airflow.providers.common.compat.openlineage.utils.spark"
PARENT_KEYS = {
    "spark.openlineage.parentJobNamespace",
    "spark.openlineage.parentJobName",
    "spark.openlineage.parentRunId",
    "spark.openlineage.rootParentJobNamespace",
    "spark.openlineage.rootParentJobName",
    "spark.openlineage.rootParentRunId",
}


def _train():
    return 1


def _op(**kwargs) -> TorchDistributorOperator:
    return TorchDistributorOperator(task_id="train", train_object=_train, **kwargs)


class LineageTI:
    """What the OpenLineage macros read of a task instance."""

    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "train", -1, 2

    def __init__(self) -> None:
        self.dag_run = SimpleNamespace(
            conf={}, logical_date=pendulum.datetime(2026, 1, 2, tz="UTC"), run_after=None, clear_number=0
        )

    def get_template_context(self) -> dict:
        return {"dag_run": self.dag_run}


def _context() -> dict:
    return {"ti": LineageTI()}


def _lineage_conf(op: TorchDistributorOperator) -> dict:
    conf = op.make_hook(_context()).spec.conf
    return {k: v for k, v in conf.items() if k.startswith("spark.openlineage.")}


@pytest.fixture(autouse=True)
def _openlineage_conf_read_afresh():
    """The OpenLineage provider caches its settings and its listener (and with it the client):
    each test reads its own environment."""
    from airflow.providers.openlineage import conf
    from airflow.providers.openlineage.plugins import listener

    def clear() -> None:
        for value in vars(conf).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
        listener.get_openlineage_listener.cache_clear()

    clear()
    yield
    clear()


def test_parent_job_information_is_the_tasks_and_reaches_spark_submits_properties(tmp_path):
    ti = LineageTI()
    hook = _op(openlineage_inject_parent_job_info=True, conf={"spark.log.level": "INFO"}).make_hook(
        {"ti": ti}
    )
    assert hook.spec.conf == {
        "spark.log.level": "INFO",
        "spark.openlineage.parentJobNamespace": "default",
        "spark.openlineage.parentJobName": "d.train",
        "spark.openlineage.parentRunId": ol_macros.lineage_run_id(ti),
        "spark.openlineage.rootParentJobNamespace": "default",
        "spark.openlineage.rootParentJobName": "d",
        "spark.openlineage.rootParentRunId": ol_macros.lineage_root_run_id(ti),
    }
    # This try's run id: a retry's application is another child of the task.
    other_try = LineageTI()
    other_try.try_number = 3
    assert ol_macros.lineage_run_id(other_try) != hook.spec.conf["spark.openlineage.parentRunId"]
    properties = plan_without_a_run(hook, tmp_path).properties
    assert {k: properties[k] for k in PARENT_KEYS} == {k: hook.spec.conf[k] for k in PARENT_KEYS}


def test_the_openlineage_namespace_setting_is_the_one_used(monkeypatch):
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__NAMESPACE", "team-ml")
    conf = _lineage_conf(_op(openlineage_inject_parent_job_info=True))
    assert conf["spark.openlineage.parentJobNamespace"] == "team-ml"
    assert conf["spark.openlineage.rootParentJobNamespace"] == "team-ml"


def test_nothing_is_injected_nor_imported_when_off(monkeypatch):
    # None means "cannot import": a flag that is off must not even load the OpenLineage helpers.
    monkeypatch.setitem(sys.modules, COMPAT, None)
    op = _op(conf={"spark.log.level": "INFO"})
    assert (op.openlineage_inject_parent_job_info, op.openlineage_inject_transport_info) == (False, False)
    assert op.make_hook(_context()).spec.conf == {"spark.log.level": "INFO"}


def test_the_openlineage_options_are_the_defaults_and_an_argument_wins(monkeypatch):
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__SPARK_INJECT_PARENT_JOB_INFO", "True")
    op = _op()
    assert (op.openlineage_inject_parent_job_info, op.openlineage_inject_transport_info) == (True, False)
    assert set(_lineage_conf(op)) == PARENT_KEYS
    assert _lineage_conf(_op(openlineage_inject_parent_job_info=False)) == {}


def test_properties_set_in_conf_are_kept(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW__OPENLINEAGE__TRANSPORT", '{"type": "http", "url": "http://lineage.example:5000"}'
    )
    conf = {
        "spark.openlineage.parentJobName": "chosen-by-the-user",
        "spark.openlineage.transport.type": "console",
    }
    op = _op(openlineage_inject_parent_job_info=True, openlineage_inject_transport_info=True, conf=conf)
    # The provider's rule: once conf holds any property of a group, none of that group is added.
    assert _lineage_conf(op) == conf


def test_transport_information_is_the_providers_http_transport_and_its_key_is_masked(monkeypatch, tmp_path):
    from airflow_provider_torchdist.submit import masking

    masked: list[str] = []
    monkeypatch.setattr(masking, "mask_secret", lambda value, *a, **k: masked.append(value))
    monkeypatch.setenv(
        "AIRFLOW__OPENLINEAGE__TRANSPORT",
        '{"type": "http", "url": "http://lineage.example:5000", "endpoint": "api/v1/lineage",'
        ' "auth": {"type": "api_key", "apiKey": "ol-key-0123456789"}}',
    )
    conf = _lineage_conf(_op(openlineage_inject_transport_info=True))
    assert conf["spark.openlineage.transport.type"] == "http"
    assert conf["spark.openlineage.transport.url"] == "http://lineage.example:5000"
    assert conf["spark.openlineage.transport.endpoint"] == "api/v1/lineage"
    key = conf["spark.openlineage.transport.auth.apiKey"]  # as the provider gives it: "Bearer ..."
    assert key.endswith("ol-key-0123456789")
    assert key in masked  # never in the task log
    assert not any(k.startswith("spark.openlineage.parent") for k in conf)  # only what was asked for


def test_without_the_openlineage_provider_nothing_changes_and_nothing_fails(monkeypatch, caplog):
    # The provider missing: its helpers cannot be imported, and the compat module imports afresh.
    monkeypatch.setitem(sys.modules, OL_HELPERS, None)
    monkeypatch.delitem(sys.modules, COMPAT, raising=False)
    package, _, module = COMPAT.rpartition(".")
    monkeypatch.delattr(importlib.import_module(package), module, raising=False)
    op = _op(openlineage_inject_parent_job_info=True, openlineage_inject_transport_info=True)
    with caplog.at_level(logging.WARNING):
        spec = op.make_hook(_context()).spec
    assert spec.conf == {}
    assert "Skipping the injection of OpenLineage parent job information" in caplog.text


def test_the_flags_are_checked_when_the_dag_is_parsed():
    with pytest.raises(InvalidTrainingConfig, match="openlineage_inject_parent_job_info"):
        _op(openlineage_inject_parent_job_info="sometimes")


@pytest.mark.parametrize("name", ["openlineage_inject_parent_job_info", "openlineage_inject_transport_info"])
def test_the_hook_refuses_them_and_says_how_to_do_it_there(name):
    with pytest.raises(InvalidTrainingConfig, match=rf"{name} need\(s\) the Airflow task's context.*conf="):
        TorchDistributorHook(**{name: True})
