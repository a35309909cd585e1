"""A real MLflow tracking server for the tests: ``mlflow server`` from ./.venv-mlflow
(scripts/install-mlflow-server), SQLite backend store and local artifact root in a folder of the
test's, on 127.0.0.1. It can be stopped and started again on the same port and store (an outage);
it is stopped by its process group, which it leads (``start_new_session``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = ROOT / ".venv-mlflow" / "bin" / "mlflow"
#: Its start (imports on a loaded 2-core machine: measured up to 150 s under the full suite).
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``start()``, ``stop()``, ``uri``; ``log`` holds its output."""

    def __init__(self, folder: Path) -> None:
        if not MLFLOW.exists():
            raise RuntimeError(f"{MLFLOW} is missing: run bash scripts/install-mlflow-server")
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            str(MLFLOW), "server",
            "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
            "--default-artifact-root", str(self.folder / "artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "1",
            # Without its job runner: MLflow 3's server otherwise starts 8 more Python processes (a
            # runner, seven huey consumers) for server-side jobs (GenAI evaluation, trace rollups)
            # that tracking and the model registry do not use: measured 41 s to healthy and about
            # 55 s of CPU per start, against 18 s and 16 s without (the outage test starts it twice).
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=out, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        # The first API call loads the stores (seconds under load): pay it here, not in a task's check.
        urllib.request.urlopen(f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=120)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Its workers were in its group too: the port is free once nothing answers on it.
        deadline = time.monotonic() + 30
        while self.answers() and time.monotonic() < deadline:
            time.sleep(0.2)

    def answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
            return True
        except OSError:
            return False
