"""A real S3-compatible object store for the tests: moto's standalone server, a separate process on
127.0.0.1, reached over HTTP by real s3fs clients (no in-process mock), stopped by its PID.

``s3_server`` (session fixture) yields an :class:`S3Server`; ``server.bucket()`` makes a fresh
bucket and returns its name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Any key works against moto; the tests still pass them the way a connection would.
KEY, SECRET = "test-key-id", "test-secret-key"
START_TIMEOUT_S = 60.0


@dataclass
class S3Server:
    """The running server: where it listens, and its log."""

    endpoint: str
    pid: int
    log: Path

    @property
    def storage_options(self) -> dict:
        """s3fs's options for this server (what ``checkpoint_conn_id`` resolves to)."""
        return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": self.endpoint}}

    def connection_uri_env(self) -> str:
        """An ``aws`` Airflow connection (JSON) for ``AIRFLOW_CONN_<ID>``."""
        return json.dumps(
            {
                "conn_type": "aws",
                "login": KEY,
                "password": SECRET,
                "extra": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            }
        )

    def filesystem(self):  # noqa: ANN201 - s3fs.S3FileSystem
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_s3_server(log: Path, host: str = "127.0.0.1") -> tuple[subprocess.Popen, S3Server]:
    """Start ``moto_server`` on a free port of ``host`` (another address for hosts in network
    namespaces); return once it answers HTTP (or fail with its log)."""
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if binary is None:
        pytest.fail("moto_server is missing: install the test extra (moto[server])")
    port = _free_port(host)
    endpoint = f"http://{host}:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "-H", host, "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(endpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_s3_server(proc)
            pytest.fail(f"moto_server did not start on {endpoint}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)  # polling for the condition (the server answers), not timing
    return proc, S3Server(endpoint, proc.pid, log)


def stop_s3_server(proc: subprocess.Popen) -> None:
    """Stop the server by its PID (its own session: nothing else is signalled)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server for the whole session."""
    proc, server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        stop_s3_server(proc)
