"""The embedded master's own traffic is authenticated, and no setting is on a command line: a real
run (spark-submit, local[2], torchrun), probed from outside while its ranks wait."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.submit.plan import SPARK_PROPERTIES_FILE
from airflow_provider_torchdist.submit.properties import read_properties
from airflow_provider_torchdist.supervision.processes import session_members

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

MARKER_SECRET = "marker-secret-7f3a9c1e5b"


def wait_for_release(started: str, release: str) -> int:
    """Every rank: say the run is live (rank 0), then wait until the test has looked at it."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        Path(started).touch()
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">i", len(data)) + data


def open_blocks_without_credentials(port: int, block: str) -> tuple[int | None, bytes]:
    """Ask the block manager at ``port`` for ``block`` the way an executor would, but with no
    authentication handshake: Spark's ``OpenBlocks`` message in an ``RpcRequest`` frame. Returns the
    reply's message type (4: RpcResponse, the request was served; 5: RpcFailure) and its bytes."""
    body = b"\x00" + _string("app") + _string("exec") + struct.pack(">i", 1) + _string(block)
    message = struct.pack(">bqi", 3, 1234, len(body)) + body
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack(">q", 8 + len(message)) + message)
        try:
            while len(reply) < 8 or len(reply) < struct.unpack(">q", reply[:8])[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
    return (reply[8] if len(reply) > 8 else None), reply


def _command_lines(pid: int) -> list[str]:
    lines = []
    for member in session_members(pid):
        try:
            lines.append(Path(f"/proc/{member}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


@pytest.mark.parametrize("authenticate", [True, False], ids=["embedded-default", "turned-off"])
def test_embedded_spark_refuses_unauthenticated_clients(authenticate: bool, tmp_path: Path) -> None:
    port = _free_port()
    conf = {"spark.blockManager.port": str(port), "spark.hadoop.fs.s3a.secret.key": MARKER_SECRET}
    if not authenticate:
        conf["spark.authenticate"] = "false"
    (tmp_path / "staging").mkdir()
    hook = TorchDistributorHook(num_processes=2, conf=conf, staging_dir=str(tmp_path / "staging"))
    started, release = tmp_path / "started", tmp_path / "release"
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = hook.run(wait_for_release, str(started), str(release))
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert thread.is_alive() and time.monotonic() < deadline, f"the run never started: {outcome}"
            time.sleep(0.05)
        properties = hook.staged.dir / SPARK_PROPERTIES_FILE
        mode = stat.S_IMODE(properties.stat().st_mode)
        props = read_properties(properties)
        command_lines = _command_lines(hook.submission.session)
        kind, reply = open_blocks_without_credentials(port, "broadcast_0_piece0")
    finally:
        release.touch()
        thread.join(120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["value"] == 0
    assert (hook.application_id or "").startswith("local-")  # the driver's own line, anchored, was seen

    assert mode == 0o600
    assert props["spark.hadoop.fs.s3a.secret.key"] == MARKER_SECRET
    # spark-submit, the driver's JVM and Python, Spark's Python workers, the agents and ranks.
    assert len(command_lines) >= 4
    secret = props.get("spark.authenticate.secret")
    for line in command_lines:
        assert "--conf" not in line and MARKER_SECRET not in line
        assert secret is None or secret not in line

    refused_for_authentication = kind == 5 and b"Sasl" in reply
    if authenticate:
        assert props["spark.authenticate"] == "true" and secret
        assert refused_for_authentication, reply[:300]
    else:
        assert "spark.authenticate.secret" not in props
        # The control: without authentication the same request is answered by the block manager.
        assert kind == 4, reply[:300]
