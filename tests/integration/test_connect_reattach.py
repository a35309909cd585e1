"""A Spark Connect run's operation: named to its owners and record, reattached to when the client's
connection to the server drops, and interrupted from the record when the run's supervisor is lost.

Training waits at a gate the test opens (files under ``tmp_path``): the test cuts connections or
kills processes while every rank is known to be training, never after a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.spark.wire.connect_ids import split_operation
from airflow_provider_torchdist.supervision.lifeline import query_status
from airflow_provider_torchdist.supervision.task_side import GONE, run_state
from tests.integration.connect_server import ConnectServer
from tests.integration.run_processes import is_supervisor, staging_of
from tests.integration.test_connect import wait_gone

pytestmark = pytest.mark.integration


def gated(gate_dir: str) -> dict[str, Any] | None:
    """Each rank notes its start and its PID and its agent's, waits for ``release``; rank 0 returns."""
    rank = int(os.environ["RANK"])
    gate = Path(gate_dir)
    with open(gate / f"started-{rank}", "a") as started:
        started.write(f"{os.getpid()}\n")
    (gate / f"training-{rank}").write_text(json.dumps([os.getpid(), os.getppid()]))
    while not (gate / "release").exists():
        time.sleep(0.1)
    return {"trained": True, "world": int(os.environ["WORLD_SIZE"])} if rank == 0 else None


def wait_training(gate: Path, alive: Any = lambda: True) -> list[int]:
    """The PIDs of both ranks and their agents, once both are at the gate."""
    files = [gate / f"training-{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert alive() and time.monotonic() < deadline, "the ranks never reached the gate"
        time.sleep(0.1)
    return [pid for f in files for pid in json.loads(f.read_text())]


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 to ``port`` whose connections the test can cut (:meth:`cut`), as a
    network drop between the Connect client and the server would; it keeps accepting new ones."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self.accepted += 1
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Drop every connection open now (both ends see it closed); returns how many there were."""
        with self._lock:
            socks, self._open = self._open, []
        for sock in socks:
            # shutdown() first: close() alone leaves the socket open while a pump thread is blocked
            # in recv() on it, and the peers would see nothing.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        return len(socks) // 2

    def close(self) -> None:
        self._listener.close()
        self.cut()


def test_a_run_outlives_its_clients_connection_dropping_by_reattaching_to_its_operation(
    connect_server: ConnectServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The Connect client's connection to the server drops mid-training: pyspark's reattachable
    execution picks the same operation up again (no second start of any rank), and the run ends
    with rank 0's value. The operation reached the hook (for the run's record) and the log."""
    proxy = CuttableProxy(connect_server.port)
    conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": proxy.port}
    monkeypatch.setenv("AIRFLOW_CONN_TORCHDIST_CONNECT_PROXIED", json.dumps(conn))
    hook = TorchDistributorHook(conn_id="torchdist_connect_proxied", num_processes=2)
    operations: list[str] = []
    hook.on_operation = operations.append
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(hook.run(gated, str(tmp_path))))
    runner.start()
    try:
        wait_training(tmp_path, runner.is_alive)
        deadline = time.monotonic() + 30  # Connect names the operation in its first progress report
        while not operations:
            assert time.monotonic() < deadline, "the run's operation never reached the hook"
            time.sleep(0.1)
        before = proxy.accepted
        assert proxy.cut() >= 1
        (tmp_path / "release").touch()
        runner.join(120)
        assert not runner.is_alive()
    finally:
        (tmp_path / "release").touch()
        proxy.close()
    assert result == [{"trained": True, "world": 2}]
    assert proxy.accepted > before, "the client never connected again after the cut"
    for rank in (0, 1):  # the same operation went on: no rank started twice
        assert len((tmp_path / f"started-{rank}").read_text().splitlines()) == 1
    (operation,) = operations
    assert split_operation(operation) is not None
    assert f"connect-operation {operation}" in "".join(capfd.readouterr())


def test_a_lost_supervisors_connect_job_is_interrupted_from_the_runs_record(
    connect_conn: str, tmp_path: Path
) -> None:
    """The run's supervisor dies with the Connect client frozen (a lost machine: the nodes cannot
    tell), so its job would hold the server's slots; the retry's hook interrupts it in the record's
    session, by the run's tag, and nothing of the run is left on the executors."""
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    record = hook.start_run(gated, [str(tmp_path)], {}, durable=True, reattach_timeout=300.0)
    hook.detach()  # no owner now: a durable run waits for the next
    (supervisor,) = [p for p in psutil.Process().children() if is_supervisor(p)]
    staging = staging_of(supervisor)
    driver = None
    try:
        pids = wait_training(tmp_path)
        deadline = time.monotonic() + 30
        while (
            operation := query_status(record.host, record.port, record.run_id, record.secret()).operation
        ) is None:
            assert time.monotonic() < deadline, "the supervisor never learnt the run's operation"
            time.sleep(0.2)
        (driver,) = [p for p in supervisor.children() if "spark.connect.driver" in " ".join(p.cmdline())]
        driver.suspend()  # frozen: its run channel stays open, so the nodes go on training
        supervisor.kill()
        supervisor.wait(10)
        assert run_state(record) == GONE
        assert all(psutil.pid_exists(p) for p in pids)  # still training: only the record can end them now

        assert record.connect_session_id == operation.split("/")[0]  # recorded from the start
        retry = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
        started = time.monotonic()
        assert retry.end_lost_run(record) == [operation.split("/")[1]]  # the run's own job, and only it
        assert not (alive := wait_gone(pids, started)), f"still on the executors after the interrupt: {alive}"
    finally:
        (tmp_path / "release").touch()
        if driver is not None:
            with contextlib.suppress(psutil.Error):
                driver.kill()
        with contextlib.suppress(psutil.Error):
            supervisor.kill()
        shutil.rmtree(staging, ignore_errors=True)  # the killed supervisor's, which it would have removed


def test_a_sigkilled_supervisor_takes_its_connect_driver_and_job_with_it(
    connect_conn: str, tmp_path: Path
) -> None:
    """The supervisor is SIGKILLed while the ranks train on the server's executors (an OOM kill, a
    lost container) and the Connect driver is left as it was: the kernel signals the driver, which
    interrupts its job. Nothing of the run is left on the executors, checked by PID, with no retry
    and no record read."""
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    hook.start_run(gated, [str(tmp_path)], {}, durable=True, reattach_timeout=300.0)
    hook.detach()  # a durable run without an owner waits for one: only the supervisor's death ends it
    (supervisor,) = [p for p in psutil.Process().children() if is_supervisor(p)]
    staging = staging_of(supervisor)
    try:
        pids = wait_training(tmp_path)
        (driver,) = [p for p in supervisor.children() if "spark.connect.driver" in " ".join(p.cmdline())]
        supervisor.kill()
        supervisor.wait(10)
        killed = time.monotonic()
        gone, alive = psutil.wait_procs([driver], timeout=20)
        assert not alive, "the Connect driver outlived its supervisor"
        assert not (left := wait_gone(pids, killed)), (
            f"still on the executors after the supervisor died: {left}"
        )
    finally:
        (tmp_path / "release").touch()
        with contextlib.suppress(psutil.Error):
            supervisor.kill()
        shutil.rmtree(staging, ignore_errors=True)  # the killed supervisor's, which it would have removed
