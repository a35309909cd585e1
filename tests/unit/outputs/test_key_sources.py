"""The signing key's ``_CMD``, ``_SECRET`` and secrets-backend forms, against a real Airflow.

Each test starts one Python process with its own ``AIRFLOW_HOME``, ``airflow.cfg`` and
environment, which imports Airflow's configuration as a task, a triggerer or the API server does,
and runs several cases in it (Airflow reads the variables afresh on every ``conf.get``). Before
``get_provider_info()`` declared ``[torchdist]`` (issue 40), Airflow skipped the ``_CMD`` and
``_SECRET`` forms of the undeclared option, the provider made a per-machine key file instead, and
the config endpoint showed the key in clear.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchdist.outputs.key_sources import SigningKeyError, read_key_option
from airflow_provider_torchdist.outputs.signing import status_view_key

KEY = "cmd-key-" + "c" * 40
SECRET_KEY = "backend-key-" + "b" * 40
PLAIN_KEY = "plain-key-" + "p" * 40

#: Runs in the real Airflow process: each case's environment, then signing_key(); then what the
#: REST API's config endpoint and ``conf.as_dict(display_sensitive=False)`` show.
SNIPPET = r"""
import json, os, sys, warnings
from pathlib import Path
from airflow_provider_torchdist.outputs.signing import KEY_FILE, SigningKeyError, signing_key, view_status_key

results = {}
for name, env in json.loads(sys.argv[1]).items():
    for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
        del os.environ[var]
    os.environ.update(env)
    try:
        results[name] = {"key": signing_key().decode()}
        view = view_status_key()
        results[name]["view"] = None if view is None else view.hex()
    except SigningKeyError as exc:
        results[name] = {"error": str(exc)}
    results[name]["key_file"] = (Path(os.environ["AIRFLOW_HOME"]) / KEY_FILE).exists()
if json.loads(sys.argv[2]):
    from airflow.api_fastapi.common.types import Mimetype
    from airflow.api_fastapi.core_api.routes.public.config import get_config
    from airflow.configuration import conf

    warnings.simplefilter("ignore")  # 'non-sensitive-only' is deprecated in 3.3: still honoured
    shown = {}
    for name in json.loads(sys.argv[2]):
        for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
            del os.environ[var]
        os.environ.update(json.loads(sys.argv[1])[name])
        as_dict = conf.as_dict(display_sensitive=False, display_source=True)
        endpoint = get_config(accept=Mimetype.JSON, section=None).model_dump()
        shown[name] = {"as_dict": json.dumps(as_dict), "endpoint": json.dumps(endpoint)}
    results["shown"] = shown
print("RESULTS " + json.dumps(results))
"""


def run_airflow(
    tmp_path: Path, cases: dict[str, dict[str, str]], cfg: str, show: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The cases' results from one real Airflow process with ``airflow.cfg`` = ``cfg``."""
    home = tmp_path / "airflow-home"
    home.mkdir()
    (home / "airflow.cfg").write_text(cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET, json.dumps(cases), json.dumps(show)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def _local_backend_reads_configs() -> bool:
    """Whether Airflow's LocalFilesystemBackend serves config values (``configs_file_path``): it
    does from Airflow 3.1; 3.0 has no built-in backend that does."""
    from airflow.secrets.local_filesystem import LocalFilesystemBackend

    return "configs_file_path" in inspect.signature(LocalFilesystemBackend).parameters


#: Airflow 3.0 (the lowest supported version): Airflow's LocalFilesystemBackend plus the config
#: file that later versions read, loaded by Airflow from ``[secrets] backend`` like any backend.
CONFIGS_BACKEND_MODULE = """
import json
from pathlib import Path

from airflow.secrets.local_filesystem import LocalFilesystemBackend


class ConfigsFileBackend(LocalFilesystemBackend):
    def __init__(self, configs_file_path: str, **kwargs):
        super().__init__(**kwargs)
        self.configs_file = configs_file_path

    def get_config(self, key: str):
        return json.loads(Path(self.configs_file).read_text()).get(key)
"""

#: The class name of the backend the tests' ``airflow.cfg`` sets (errors name it).
BACKEND = "LocalFilesystemBackend" if _local_backend_reads_configs() else "ConfigsFileBackend"


def backend_cfg(tmp_path: Path, extra: str = "") -> str:
    """An airflow.cfg whose secrets backend is Airflow's LocalFilesystemBackend (on 3.0, the
    subclass above, next to the process's cwd ``tmp_path``), holding one config entry,
    ``torchdist_signing``."""
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"torchdist_signing": SECRET_KEY}))
    backend = "airflow.secrets.local_filesystem.LocalFilesystemBackend"
    if BACKEND != "LocalFilesystemBackend":
        (tmp_path / "configs_file_backend.py").write_text(CONFIGS_BACKEND_MODULE)
        backend = f"configs_file_backend.{BACKEND}"
    return (
        # [webserver] is where Airflow 3.0's config endpoint reads it; later versions, [api].
        "[api]\nexpose_config = non-sensitive-only\n[webserver]\nexpose_config = non-sensitive-only\n"
        f"[secrets]\nbackend = {backend}\n"
        f'backend_kwargs = {{"configs_file_path": "{configs}"}}\n' + extra
    )


ENV = "AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY"


@pytest.fixture(scope="module")
def env_forms(tmp_path_factory) -> dict[str, Any]:
    """One real Airflow process for the environment's forms and for what the config shows."""
    tmp_path = tmp_path_factory.mktemp("env-forms")
    return run_airflow(
        tmp_path,
        {
            "cmd": {f"{ENV}_CMD": f"echo {KEY}"},
            "secret": {f"{ENV}_SECRET": "torchdist_signing"},
            "cmd prints nothing": {f"{ENV}_CMD": "true"},
            "cmd fails": {f"{ENV}_CMD": "false"},
            "secret missing": {f"{ENV}_SECRET": "no_such_entry"},
            "cmd and a plain key": {f"{ENV}_CMD": f"echo {KEY}", ENV: "x"},
            "bad view key": {f"{ENV}_CMD": f"echo {KEY}", "AIRFLOW__TORCHDIST__VIEW_STATUS_KEY": "x"},
            "plain": {ENV: PLAIN_KEY},
            "view key": {"AIRFLOW__TORCHDIST__VIEW_STATUS_KEY": "ab" * 32},
        },
        backend_cfg(tmp_path),
        show=("plain", "cmd", "view key"),
    )


def test_the_cmd_and_secret_variables_give_the_key_or_are_refused_never_a_made_up_one(env_forms):
    results, env = env_forms, ENV
    assert results["cmd"]["key"] == KEY  # the command's output, stripped
    assert results["secret"]["key"] == SECRET_KEY  # from the secrets backend
    # The API server's status key is derived from the key, not the key.
    assert results["cmd"]["view"] == status_view_key(KEY.encode()).hex()
    for case, form, why in [
        ("cmd prints nothing", "_CMD", "the command printed nothing"),
        ("cmd fails", "_CMD", "cannot be read from"),
        ("secret missing", "_SECRET", f"{BACKEND} has no such entry"),
    ]:
        error = results[case].get("error", "")
        assert f"{env}{form}" in error and why in error, (case, results[case])
        assert not results[case]["key_file"], f"{case}: a per-machine key was made instead"
    assert BACKEND in results["secret missing"]["error"]
    # The plain variable comes first in Airflow's order (and this one is too short).
    assert results["cmd and a plain key"]["error"].startswith(f"The output signing key in {env} has 1 bytes")
    assert "VIEW_STATUS_KEY must be the 64 hex characters" in results["bad view key"]["error"]


def test_the_secret_form_in_airflow_cfg_reads_the_backend(tmp_path):
    results = run_airflow(
        tmp_path,
        {"cfg secret": {}, "env cmd as well": {"AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY_CMD": f"echo {KEY}"}},
        backend_cfg(tmp_path, "[torchdist]\noutput_signing_key_secret = torchdist_signing\n"),
    )
    assert results["cfg secret"]["key"] == SECRET_KEY and not results["cfg secret"]["key_file"]
    # Two indirect forms: if the variable's command printed nothing Airflow would quietly read the
    # backend, so the pair is refused, naming both.
    error = results["env cmd as well"]["error"]
    assert "more than one way" in error and "OUTPUT_SIGNING_KEY_CMD" in error
    assert "output_signing_key_secret in airflow.cfg" in error


def test_the_config_endpoint_and_as_dict_never_show_the_key(env_forms):
    """``[api] expose_config = non-sensitive-only``: the REST API's ``GET /api/v2/config`` (its route
    function, called as FastAPI calls it, minus authentication) and ``conf.as_dict``."""
    results = env_forms
    shown = results["shown"]
    for case, secret in [("plain", PLAIN_KEY), ("cmd", KEY), ("view key", "ab" * 32)]:
        for where in ("as_dict", "endpoint"):
            assert secret not in shown[case][where], f"{where} shows the {case} key"
        assert "< hidden >" in shown[case]["endpoint"], shown[case]["endpoint"]
    # The rest of [torchdist] is shown, with its declared defaults.
    assert '"key": "lifeline_host", "value": "127.0.0.1"' in shown["plain"]["endpoint"]


def test_read_key_option_here_names_where_the_key_came_from(monkeypatch):
    """In this process (the unit tests' Airflow): the source is named, the value never is."""
    for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY_CMD", f"echo {KEY}")
    configured = read_key_option("output_signing_key")
    assert configured.value.strip() == KEY
    assert configured.source is not None
    assert configured.source.describe() == "AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY_CMD (a command's output)"
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY_CMD", "printf ''")
    with pytest.raises(
        SigningKeyError,
        match=r"OUTPUT_SIGNING_KEY_CMD is set, but .* resolves to nothing \(the command printed nothing\)",
    ):
        read_key_option("output_signing_key")


def test_the_doctor_says_where_the_key_comes_from_never_the_key(monkeypatch, tmp_path):
    from airflow_provider_torchdist import doctor

    for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv(f"{ENV}_CMD", f"echo {KEY}")
    found = doctor._signing_key()
    assert found.ok and found.detail == f"from {ENV}_CMD (a command's output)"
    monkeypatch.setenv(f"{ENV}_CMD", "true")
    found = doctor._signing_key()
    assert not found.ok and f"{ENV}_CMD is set, but" in found.detail
    monkeypatch.delenv(f"{ENV}_CMD")
    monkeypatch.setenv(f"{ENV}_SECRET", "torchdist_signing")  # no [secrets] backend here
    found = doctor._signing_key()
    assert not found.ok and "has no such entry" in found.detail
    monkeypatch.delenv(f"{ENV}_SECRET")
    monkeypatch.setenv(ENV, PLAIN_KEY)
    assert doctor._signing_key().detail == f"from {ENV}"
    assert not list(tmp_path.iterdir())  # the doctor makes no key file


def test_status_key_prints_the_view_key_of_this_deployment(tmp_path, monkeypatch, capsys):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__TORCHDIST__")}
    env.update({"AIRFLOW_HOME": str(tmp_path), ENV: PLAIN_KEY})
    done = subprocess.run(
        [sys.executable, "-m", "airflow_provider_torchdist", "status-key"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == status_view_key(PLAIN_KEY.encode()).hex()
    assert PLAIN_KEY not in done.stdout
    # No key here: it says so, and makes none (in this process: the same function).
    from airflow_provider_torchdist.__main__ import main

    for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    assert main(["status-key"]) == 1
    assert "No output signing key" in capsys.readouterr().err
    assert not (tmp_path / "torchdist_output_signing.key").exists()


def _train() -> int:
    return 1


def test_a_run_whose_key_command_prints_nothing_stops_before_spark_submit_leaving_nothing(
    no_submit, monkeypatch, tmp_path
):
    """Refused at the hand-over to the supervisor (where the run's credentials are derived): no
    supervisor, no spark-submit, no staging directory left, no key file made."""
    from airflow_provider_torchdist import TorchDistributorHook

    for var in [v for v in os.environ if v.startswith("AIRFLOW__TORCHDIST__")]:
        monkeypatch.delenv(var)
    home, staging = tmp_path / "home", tmp_path / "staging"
    home.mkdir()
    staging.mkdir()
    monkeypatch.setenv("AIRFLOW_HOME", str(home))
    monkeypatch.setenv(f"{ENV}_CMD", "true")
    hook = TorchDistributorHook(num_processes=1, local_mode=True, staging_dir=str(staging))
    with pytest.raises(SigningKeyError, match=f"{ENV}_CMD is set, but"):
        hook.start_run(_train, durable=False)
    assert no_submit == []
    assert list(staging.iterdir()) == [] and list(home.iterdir()) == []
