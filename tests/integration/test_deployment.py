"""A real deployment: ``scripts/airflow-standalone`` (API server, scheduler, DAG processor and
triggerer as separate processes; LocalExecutor; SQLite) serving dags/, driven through the REST API
like a user would, then looked at in the UI.

The deployment runs with ``TORCHDIST_NO_LOGIN=1`` (SimpleAuthManager's ``all_admins``): the UI
needs no login, so headless Chromium can screenshot it, and the API token comes from
``GET /auth/token``. Every request still carries that token, and a bad one is refused.

The screenshot goes to ``artifacts/dag_run.png``. Chromium is installed by
``scripts/install-chromium`` (which ``scripts/test`` runs) when missing; the test fails without it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "airflow-standalone"
INSTALL_CHROMIUM = ROOT / "scripts" / "install-chromium"
SCREENSHOT = ROOT / "artifacts" / "dag_run.png"
DAG_ID = "ui_triggered_training"
CONF = {"num_processes": 2, "local_mode": False, "learning_rate": 0.1, "epochs": 5}
READY_TIMEOUT = 240
RUN_TIMEOUT = 300


class ApiError(Exception):
    """A non-2xx answer from the REST API."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


@dataclass
class Deployment:
    """A running ``scripts/airflow-standalone`` and a REST client for it."""

    url: str
    home: Path
    pgid: int
    token: str = ""

    def call(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        """One REST call with the bearer token; JSON in, JSON out."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token or self.token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    def log_tail(self, lines: int = 60) -> str:
        """The end of the launcher's and the components' output, for failure messages."""
        parts = []
        for name in ("launcher.log", "api-server.log", "scheduler.log", "dag-processor.log", "triggerer.log"):
            path = self.home / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 1.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def processes_of(home: Path, pgid: int) -> list[psutil.Process]:
    """Every live process of this deployment: in the launcher's process group, or started with its
    AIRFLOW_HOME (task processes give spark-submit a session of its own)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == pgid or proc.environ().get("AIRFLOW_HOME") == str(home):
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def stop_deployment(launcher: subprocess.Popen[bytes], home: Path) -> list[str]:
    """SIGTERM the launcher (it stops the components cleanly), then force whatever is left; return
    what had to be forced."""
    pgid = launcher.pid
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    forced = []
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        left = processes_of(home, pgid)
        if not left:
            break
        forced += [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if sig == signal.SIGTERM]
        for proc in left:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=grace)
    launcher.wait(timeout=10)
    return forced


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Start ``scripts/airflow-standalone`` in a temp AIRFLOW_HOME on a free port; stop it all after."""
    home = tmp_path_factory.mktemp("airflow_standalone_home")
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AIRFLOW__", "AIRFLOW_CONN_")) and key != "VIRTUAL_ENV"
    }
    env |= {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_PORT": str(port),
        "TORCHDIST_NO_LOGIN": "1",
        "READY_TIMEOUT": str(READY_TIMEOUT),
        # A PATH without the venv: the launcher must put it there itself (components run as `airflow`).
        "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p),
    }
    started = time.monotonic()
    with open(home / "launcher.log", "wb") as out:
        launcher = subprocess.Popen(
            ["bash", str(LAUNCHER)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deployment = Deployment(url=f"http://127.0.0.1:{port}", home=home, pgid=launcher.pid)
    try:

        def ready() -> bool:
            assert launcher.poll() is None, (
                f"the launcher exited ({launcher.returncode}):\n{deployment.log_tail()}"
            )
            return "Airflow is ready at" in (home / "launcher.log").read_text(errors="replace")

        wait_for(ready, READY_TIMEOUT + 30, "scripts/airflow-standalone to report ready")
        print(f"deployment ready in {time.monotonic() - started:.1f} s")
        yield deployment
    finally:
        forced = stop_deployment(launcher, home)
        left = processes_of(home, launcher.pid)
        assert not left, f"processes left running: {[' '.join(p.cmdline())[:120] for p in left]}"
        # The launcher stops its components by itself; having to force them is a bug.
        assert not forced, f"processes outlived the launcher's clean stop: {forced}"


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
