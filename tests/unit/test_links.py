"""The task's extra links: the driver's Spark UI (live only), the master's page and the history server's."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_torchdist import links
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.links import (
    SPARK_HISTORY_XCOM_KEY,
    SPARK_MASTER_APP_XCOM_KEY,
    SPARK_UI_XCOM_KEY,
    ApplicationLinks,
    MlflowRunLink,
    SparkHistoryServerLink,
    SparkMasterAppLink,
    SparkUILink,
)
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.operators.xcom import link_pusher


def test_links_are_made_from_the_application_id_and_the_connection_extras() -> None:
    found = ApplicationLinks.of(
        "app-20261123-0001",
        "http://10.0.0.5:4040",
        master_web_ui="http://spark-master:8080/",
        history_server="http://spark-history:18080/",
    )
    assert found.master_page == "http://spark-master:8080/app/?appId=app-20261123-0001"
    assert found.history_page == "http://spark-history:18080/history/app-20261123-0001/"
    assert found.xcom_values() == {
        SPARK_UI_XCOM_KEY: "http://10.0.0.5:4040",
        SPARK_MASTER_APP_XCOM_KEY: "http://spark-master:8080/app/?appId=app-20261123-0001",
        SPARK_HISTORY_XCOM_KEY: "http://spark-history:18080/history/app-20261123-0001/",
    }


def test_without_the_extras_only_the_spark_ui_link_is_pushed() -> None:
    assert ApplicationLinks.of("local-1763890000", "http://127.0.0.1:4040").xcom_values() == {
        SPARK_UI_XCOM_KEY: "http://127.0.0.1:4040"
    }
    assert ApplicationLinks.of("local-1763890000", None).xcom_values() == {}


def test_the_hook_hands_on_the_history_page_of_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = {
        "conn_type": "spark",
        "host": "spark://spark-master.example.com",
        "port": 7077,
        "extra": {"history-server-url": "http://spark-history.example.com:18080"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))
    hook = TorchDistributorHook(num_processes=2)
    assert hook.target.history_server == "http://spark-history.example.com:18080"
    seen: list[ApplicationLinks] = []
    hook.on_application = seen.append
    hook._application_started("app-1", "http://driver:4040")  # what the driver's app event calls
    assert seen == [
        ApplicationLinks(
            "app-1",
            spark_ui="http://driver:4040",
            history_page="http://spark-history.example.com:18080/history/app-1/",
        )
    ]


def test_the_embedded_master_has_no_history_server() -> None:
    assert TorchDistributorHook(num_processes=2).target.history_server is None


def test_the_operator_pushes_every_link_it_has_and_reads_each_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pushed: dict[str, Any] = {}
    ti = SimpleNamespace(xcom_push=lambda key, value: pushed.__setitem__(key, value))
    link_pusher(ti)(ApplicationLinks.of("app-1", "http://driver:4040", history_server="http://history:18080"))
    assert pushed == {
        SPARK_UI_XCOM_KEY: "http://driver:4040",
        SPARK_HISTORY_XCOM_KEY: "http://history:18080/history/app-1/",
    }

    monkeypatch.setattr(links, "XCom", SimpleNamespace(get_value=lambda ti_key, key: pushed.get(key)))
    operator = TorchDistributorOperator(task_id="train", train_object="train.py")
    buttons = {link.name: link.get_link(operator, ti_key=None) for link in operator.operator_extra_links}
    assert buttons == {
        SparkUILink.name: "http://driver:4040",
        SparkMasterAppLink.name: "",  # no master-web-ui on the connection
        SparkHistoryServerLink.name: "http://history:18080/history/app-1/",
        MlflowRunLink.name: "",  # no mlflow_conn_id
    }
