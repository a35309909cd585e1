"""A real deployment: ``scripts/airflow-standalone`` (API server, scheduler, DAG processor and
triggerer as separate processes; LocalExecutor; PostgreSQL) serving dags/, driven through the REST API
like a user would, then looked at in the UI. The deployment is the session's shared one (the
``deployment`` fixture in conftest.py, helpers in deployment.py).

The deployment runs with ``TORCHDIST_NO_LOGIN=1`` (SimpleAuthManager's ``all_admins``): the UI
needs no login, so headless Chromium can screenshot it, and the API token comes from
``GET /auth/token``. Every request still carries that token, and a bad one is refused.

The screenshot goes to ``artifacts/dag_run.png``. Chromium is installed by
``scripts/install-chromium`` (which ``scripts/test`` runs) when missing; the test fails without it.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.deployment import ROOT, ApiError, Deployment, processes_of, wait_for

pytestmark = pytest.mark.integration

INSTALL_CHROMIUM = ROOT / "scripts" / "install-chromium"
SCREENSHOT = ROOT / "artifacts" / "dag_run.png"
DAG_ID = "ui_triggered_training"
CONF = {"num_processes": 2, "local_mode": False, "learning_rate": 0.1, "epochs": 5}
RUN_TIMEOUT = 300


def test_every_server_listens_on_loopback_only(deployment: Deployment) -> None:
    """The API server on its port, and nothing of the deployment on another interface."""
    listening: dict[tuple[str, int], str] = {}
    for proc in processes_of(deployment.home, deployment.pgid):
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[(conn.laddr.ip, conn.laddr.port)] = " ".join(proc.cmdline())[:80]
        except psutil.Error:
            continue
    port = int(deployment.url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in listening, listening
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening


@pytest.fixture(scope="module")
def triggered_run(deployment: Deployment) -> dict[str, Any]:
    """Through the REST API: token, unpause, trigger with a conf, wait until the run ends."""
    deployment.token = deployment.call("GET", "/auth/token")["access_token"]
    with pytest.raises(ApiError) as refused:
        deployment.call("GET", "/api/v2/dags", token="not-a-token")
    assert refused.value.status in (401, 403)

    def parsed() -> bool:
        try:
            return deployment.call("GET", f"/api/v2/dags/{DAG_ID}")["dag_id"] == DAG_ID
        except ApiError:
            return False

    wait_for(parsed, 120, f"the DAG processor to parse {DAG_ID}")
    # An out-of-range conf is refused at trigger time, before any run exists.
    with pytest.raises(ApiError) as bad_conf:
        deployment.call(
            "POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": {"num_processes": 9}}
        )
    assert bad_conf.value.status == 400 and "num_processes" in bad_conf.value.body

    assert deployment.call("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})["is_paused"] is False
    run = deployment.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": CONF})
    run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run['dag_run_id'], safe='')}"
    started = time.monotonic()

    def finished() -> dict[str, Any] | None:
        current = deployment.call("GET", run_path)
        return current if current["state"] in ("success", "failed") else None

    final = wait_for(finished, RUN_TIMEOUT, f"the {DAG_ID} run to finish", interval=2)
    print(f"dag run finished ({final['state']}) in {time.monotonic() - started:.1f} s")
    if final["state"] != "success":
        try:
            task_log = json.dumps(deployment.call("GET", f"{run_path}/taskInstances/train/logs/1"))[-5000:]
        except ApiError as exc:
            task_log = str(exc)
        pytest.fail(f"the run ended {final['state']}:\n{task_log}\n{deployment.log_tail()}")
    return {**final, "path": run_path}


def test_rest_api_run_returns_rank_zero_result(deployment: Deployment, triggered_run: dict[str, Any]) -> None:
    assert triggered_run["conf"] == CONF
    assert triggered_run["run_type"] == "manual" and triggered_run["logical_date"] is None
    entry = deployment.call("GET", f"{triggered_run['path']}/taskInstances/train/xcomEntries/return_value")
    result = entry["value"]
    assert result["rank"] == 0
    assert result["world_size"] == CONF["num_processes"]
    assert result["epochs"] == CONF["epochs"] and result["learning_rate"] == CONF["learning_rate"]
    metrics = deployment.call("GET", f"{triggered_run['path']}/taskInstances/train/xcomEntries/metrics")
    assert [m["step"] for m in metrics["value"]] == list(range(CONF["epochs"]))


def chromium() -> str | None:
    """The Chromium binary, installed with scripts/install-chromium when missing; None if that fails."""
    names = ("chromium", "chromium-browser", "google-chrome")
    found = next((shutil.which(n) for n in names if shutil.which(n)), None)
    if found:
        return found
    proc = subprocess.run(["bash", str(INSTALL_CHROMIUM)], capture_output=True, text=True, timeout=900)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None


def browse(binary: str, profile: Path, url: str, *action: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url``: loads it, lets its scripts run, then performs ``action``."""
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,900",
        "--virtual-time-budget=10000",
        *action,
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_ui_shows_the_dag_run_without_login(
    deployment: Deployment, triggered_run: dict[str, Any], tmp_path: Path
) -> None:
    binary = chromium()
    if binary is None:
        pytest.fail("Chromium is not installed and scripts/install-chromium could not install it")
    run_id = triggered_run["dag_run_id"]
    url = f"{deployment.url}/dags/{DAG_ID}/runs/{urllib.parse.quote(run_id, safe='')}"

    # What the browser renders: the run's page itself (no login form), with its state.
    dom = browse(binary, tmp_path / "profile-dom", url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert run_id in dom.stdout and "TorchDistributorOperator" in dom.stdout, dom.stdout[-3000:]
    assert "Success" in dom.stdout
    assert 'type="password"' not in dom.stdout

    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = browse(binary, tmp_path / "profile-shot", url, f"--screenshot={SCREENSHOT}")
    assert shot.returncode == 0 and SCREENSHOT.exists(), shot.stderr[-3000:]
    assert png_size(SCREENSHOT) == (1400, 900)
    assert SCREENSHOT.stat().st_size > 30_000  # a blank or error page compresses to a few KB
