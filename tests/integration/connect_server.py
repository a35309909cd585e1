"""A throwaway Spark Connect server for the tests: ``spark-submit`` of the venv's pyspark running
``SparkConnectServer`` on a free port of 127.0.0.1, in a session of its own.

``start_connect_server`` returns once the server's gRPC port accepts a TCP connection;
``ConnectServer.stop`` ends the server's whole session (the JVM, Spark's Python daemon and its
workers) with :func:`airflow_provider_torchdist.supervision.processes.end_session` and fails if any of it is
left. The ``connect_server`` fixture (registered in ``conftest.py``, so one server for the whole
test session) serves every test that asks for it::

    def test_something(connect_server):
        spark = SparkSession.builder.remote(connect_server.url).getOrCreate()

The server's Python daemon outlives each job (it is Spark's, reused across jobs), so a test that
uses the server cannot also use ``no_leftovers``: the server checks its own leftovers when it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from airflow_provider_torchdist.supervision.processes import end_session, session_members, start_detached
from tests.integration.deployment import free_port

if TYPE_CHECKING:
    from tests.cluster import ClusterInfo

HOST = "127.0.0.1"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
#: From spark-submit to the gRPC port accepting connections (a JVM and a SparkContext start).
START_TIMEOUT = 90
#: Between SIGTERM and SIGKILL when stopping, and again after SIGKILL.
STOP_GRACE = 15.0


@dataclass
class ConnectServer:
    """A running Spark Connect server of our own: ``pid`` leads its session (``spark-submit``)."""

    url: str
    port: int
    pid: int
    log_path: Path
    process: subprocess.Popen[bytes]
    root: Path

    def log_tail(self, lines: int = 60) -> str:
        text = (
            self.log_path.read_text(errors="replace").splitlines()[-lines:] if self.log_path.exists() else []
        )
        return f"--- {self.log_path}\n" + "\n".join(text)

    def stop(self) -> None:
        """End every process of the server's session (SIGTERM, up to 15 s, SIGKILL), reap
        spark-submit, remove the temp dir, and fail if any process of the session is left."""
        left = end_session(self.pid, grace=STOP_GRACE)
        try:
            self.process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
        left = left or session_members(self.pid)
        log = self.log_tail()
        if not left:
            shutil.rmtree(self.root, ignore_errors=True)
        assert not left, f"Spark Connect server processes left after SIGKILL: {left}\n{log}"


def spark_submit() -> Path:
    """The venv's spark-submit (pyspark's), beside this Python."""
    return Path(sys.executable).parent / "spark-submit"


def start_connect_server(master: str = "local[2]", conf: dict[str, str] | None = None) -> ConnectServer:
    """Start a Spark Connect server on ``master`` with ``conf`` on top of ours, listening on a free
    port of 127.0.0.1; returns once the port accepts connections, fails (with the log's tail) if
    the server exits first or takes over 90 s."""
    root = Path(tempfile.mkdtemp(prefix="spark-connect-for-tests-"))
    log_path = root / "server.log"
    port = free_port()
    settings = {
        "spark.connect.grpc.binding.address": HOST,
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.host": HOST,
        "spark.driver.bindAddress": HOST,
        "spark.ui.enabled": "false",
        # Scratch space and the warehouse in the temp dir, not in the working directory.
        "spark.local.dir": str(root / "local"),
        "spark.sql.warehouse.dir": str(root / "warehouse"),
        **(conf or {}),
    }
    cmd = [str(spark_submit()), "--master", master, "--class", SERVER_CLASS]
    for key, value in settings.items():
        cmd += ["--conf", f"{key}={value}"]
    cmd.append("spark-internal")
    env = {key: value for key, value in os.environ.items() if key != "SPARK_HOME"}  # pyspark's own
    env.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=HOST)
    process = start_detached(cmd, env=env, cwd=root, log=log_path)
    server = ConnectServer(
        url=f"sc://{HOST}:{port}", port=port, pid=process.pid, log_path=log_path, process=process, root=root
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _accepts(port):
            if process.poll() is not None:
                pytest.fail(f"the Spark Connect server exited ({process.returncode}):\n{server.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the Spark Connect server did not listen on {HOST}:{port} within "
                    f"{START_TIMEOUT} s:\n{server.log_tail()}"
                )
            time.sleep(0.2)
    except BaseException:
        server.stop()
        raise
    return server


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def connect_server() -> Iterator[ConnectServer]:
    """One Spark Connect server (``local[2]``) for the whole test session, stopped at its end with
    nothing of it left."""
    server = start_connect_server()
    try:
        yield server
    finally:
        server.stop()


CONN_ID = "torchdist_connect"


@pytest.fixture
def connect_conn(
    connect_server: ConnectServer,  # noqa: F811 (the fixture above)
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """A ``spark_connect`` connection (the Spark provider's type) to the session's server (over
    loopback, so an elastic run needs no TLS); the provider's caches in a directory of the tests' own."""
    conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_server.port}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(conn))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "connect-cache"))
    return CONN_ID


@contextlib.contextmanager
def connect_on_cluster(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, conf: dict[str, str] | None = None
) -> Iterator[str]:
    """A Connect server whose master is the netns ``cluster`` (its driver on the bridge, its
    executors on the test hosts), and a ``spark_connect`` connection to it over 127.0.0.1, whose id
    this yields; the server is stopped afterwards, its application with it."""
    server = start_connect_server(
        master=cluster.master_url,
        conf={
            "spark.driver.host": cluster.driver_host,
            "spark.driver.bindAddress": cluster.driver_host,
            "spark.executor.memory": "512m",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            **(conf or {}),
        },
    )
    try:
        conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": server.port}
        monkeypatch.setenv("AIRFLOW_CONN_CLUSTER_CONNECT", json.dumps(conn))
        yield "cluster_connect"
    finally:
        server.stop()
