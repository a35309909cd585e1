"""Provider metadata: valid for Airflow's schema, its classes import, and Airflow lists the provider."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
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


# -- the [torchdist] options -------------------------------------------------------------------------

#: ``conf.get("torchdist", "name", fallback=...)`` (any of conf's getters), and the secret options
#: read through ``read_key_option("name")``.
_CONF_READ = re.compile(r'\.get\w*\(\s*"torchdist",\s*"(\w+)"(?:,\s*fallback=("[^"]*"|None))?')
_KEY_READ = re.compile(r'read_key_option\(\s*"(\w+)"')


def options_the_code_reads() -> dict[str, str | None]:
    """Every ``[torchdist]`` option the package reads, with the fallback it reads it with."""
    package = Path(__file__).resolve().parents[2] / "airflow_provider_torchdist"
    found: dict[str, str | None] = {}
    for path in package.rglob("*.py"):
        text = path.read_text()
        for name, fallback in _CONF_READ.findall(text):
            found[name] = None if fallback in ("", "None") else fallback.strip('"')
        for name in _KEY_READ.findall(text):
            found[name] = None
    return found


def test_every_torchdist_option_the_code_reads_is_declared_with_its_fallback() -> None:
    """Undeclared, an option is not sensitive: Airflow ignores its _CMD/_SECRET forms and shows it
    in the config (issue 40)."""
    declared = get_provider_info()["config"]["torchdist"]["options"]
    read = options_the_code_reads()
    # The scan itself finds what it must (a change to how options are read would blind it).
    assert {"output_signing_key", "view_status_key", "lifeline_host", "supervisor_start"} <= set(read)
    assert set(read) == set(declared), "declare every [torchdist] option in get_provider_info()['config']"
    for name, fallback in read.items():
        assert declared[name]["default"] == fallback, name
    sensitive = {name for name, option in declared.items() if option.get("sensitive")}
    assert sensitive == {"output_signing_key", "view_status_key"}


def test_airflow_resolves_the_declared_options_defaults() -> None:
    """The declared defaults are what Airflow's own configuration answers with.

    From Airflow 3.1 ``conf`` reads providers' declared defaults on demand. Airflow 3.0 knows them
    only once the providers' configuration is loaded, which its CLI and servers do at start but a
    process that merely imports Airflow may not: there, only the ``fallback=`` of every read (the
    test above) gives the defaults, so this loads the configuration as Airflow 3.0 does first."""
    from airflow.configuration import conf

    from airflow_provider_torchdist.supervision.lifeline_hosts import lifeline_host

    assert lifeline_host() == "127.0.0.1"  # our read, on every version
    if not hasattr(conf, "get_from_provider_metadata_config_fallback_defaults"):  # Airflow 3.0
        from airflow.providers_manager import ProvidersManager

        ProvidersManager().initialize_providers_configuration()
    assert conf.get("torchdist", "lifeline_host") == "127.0.0.1"
    assert conf.get("torchdist", "supervisor_start") == "fork"
    assert ("torchdist", "output_signing_key") in conf.sensitive_config_values


def config_table(options: dict[str, dict]) -> str:
    """docs/reference.md's ``[torchdist]`` table, rendered from the declared options."""
    rows = ["| Option | Default | Secret | What it does |", "|---|---|---|---|"]
    for name, option in options.items():
        default = "none" if option["default"] is None else f"`{option['default']!r}`"
        secret = "yes: also `_CMD`, `_SECRET`" if option.get("sensitive") else ""
        # The name in bold: docs/tools/reference_table.py reads rows opening with a backtick as the
        # operator's arguments.
        rows.append(f"| **`{name}`** | {default} | {secret} | {option['description']} |")
    return "\n".join(rows)


def test_the_reference_lists_the_declared_options() -> None:
    """docs/reference.md's table is get_provider_info()'s (print ``config_table`` to refresh it)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    match = re.search(r"<!-- reference:config:start -->\n(.*?)\n<!-- reference:config:end -->", page, re.S)
    assert match is not None, "docs/reference.md lost its [torchdist] options table"
    expected = config_table(get_provider_info()["config"]["torchdist"]["options"])
    assert match[1] == expected, "docs/reference.md's [torchdist] table is stale:\n" + expected
