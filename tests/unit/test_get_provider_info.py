"""Provider metadata: valid for Airflow's schema, its classes import, and Airflow lists the provider."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import airflow
import jsonschema
from packaging.version import Version

from airflow_provider_torchdist import __version__
from airflow_provider_torchdist.get_provider_info import get_provider_info

AIRFLOW_VERSION = Version(airflow.__version__).release

PACKAGE = "airflow-provider-torchdist"


def import_path(dotted: str) -> object:
    """The object at ``package.module.Name`` (or the module at ``package.module``)."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def test_provider_info_is_valid_for_the_installed_airflow_schema() -> None:
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == PACKAGE
    assert info["versions"] == [__version__]


def test_provider_info_classes_and_modules_import() -> None:
    info = get_provider_info()
    modules = [
        m for section in ("operators", "hooks") for entry in info[section] for m in entry["python-modules"]
    ]
    for dotted in modules + info.get("extra-links", []):
        assert import_path(dotted) is not None, dotted
    from airflow.sdk import BaseOperatorLink

    for dotted in info.get("extra-links", []):
        assert issubclass(import_path(dotted), BaseOperatorLink), dotted


def test_connection_form_declares_the_master_web_ui_and_history_server_fields() -> None:
    """Airflow's UI builds the "PyTorch on Spark" form from provider info alone (no hook import)."""
    from airflow.providers_manager import ProvidersManager

    try:  # Airflow 3.2+: hooks are the Task SDK's business
        from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
    except ImportError:  # 3.0 and 3.1 (the lowest-version CI env)
        ProvidersManagerTaskRuntime = ProvidersManager  # noqa: N806

    manager = ProvidersManager()
    widgets = manager.connection_form_widgets
    hooks = ProvidersManagerTaskRuntime().hooks
    assert hooks["torchdist_spark"].hook_name == "PyTorch on Spark"
    # The Spark provider's own "spark" type is left as it is.
    assert hooks["spark"].package_name == "apache-airflow-providers-apache-spark"
    if AIRFLOW_VERSION < (3, 2):
        # Forms from provider info ("conn-fields") arrived in Airflow 3.2; before, the type is there
        # with its plain form, and the same keys go into Extra (README: install).
        assert "extra__torchdist_spark__master-web-ui" not in widgets
        return
    field = widgets["extra__torchdist_spark__master-web-ui"]
    assert field.package_name == PACKAGE
    assert field.field["schema"]["title"] == "Master web UI"
    assert "too big for the cluster" in field.field["description"]
    history = widgets["extra__torchdist_spark__history-server-url"]
    assert history.field["schema"]["title"] == "Spark history server"
    assert "gone with the run" in history.field["description"]
    behaviour = manager.field_behaviours["torchdist_spark"]
    assert behaviour["relabeling"] == {"host": "Master"}
    assert "extra" in behaviour["hidden_fields"]


def test_torchdist_spark_connection_resolves_like_a_spark_one(monkeypatch) -> None:
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook

    conn = {
        "conn_type": "torchdist_spark",
        "host": "spark://spark-master.example.com",
        "port": 7077,
        "extra": {"master-web-ui": "http://spark-master.example.com:8080", "spark-binary": "spark-submit"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_TORCH_CLUSTER", json.dumps(conn))
    hook = TorchDistributorHook(num_processes=2, conn_id="torch_cluster")

    assert hook.target.master == "spark://spark-master.example.com:7077"
    assert hook.target.master_web_ui == "http://spark-master.example.com:8080"
    assert not hook.embedded
    # Handed on as the "spark" connection it mirrors: the Spark provider builds master URLs for
    # that type only (tests/unit/submit/test_plan.py checks the provider reads the same master).
    assert hook.target.connection == {
        "conn_type": "spark",
        "host": "spark://spark-master.example.com",
        "port": 7077,
        "extra": conn["extra"],
    }


def test_entry_point_points_at_get_provider_info() -> None:
    points = importlib.metadata.entry_points(group="apache_airflow_provider")
    ours = [ep for ep in points if ep.value.startswith("airflow_provider_torchdist.")]
    assert [ep.load() for ep in ours] == [get_provider_info]


def test_airflow_providers_list_shows_the_provider() -> None:
    env = {**os.environ, "AIRFLOW__LOGGING__LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    providers = {p["package_name"]: p for p in json.loads(proc.stdout[proc.stdout.index("[") :])}
    assert PACKAGE in providers, sorted(providers)
    assert providers[PACKAGE]["version"] == __version__
    assert "apache-airflow-providers-apache-spark" in providers
