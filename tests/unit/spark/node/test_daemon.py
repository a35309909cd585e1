"""The executors' Python daemon (``spark/node/daemon.py``), started for real as Spark starts it:
``python -m <module>``, its port on stdout, its end when stdin closes."""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import time

import psutil
import pytest

from airflow_provider_torchdist.spark.node import daemon
from airflow_provider_torchdist.spark.node.daemon import DAEMON_MODULE, PRELOAD_ENV


def _start(module: str, **environ: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, **environ},
    )
    assert proc.stdout is not None
    (port,) = struct.unpack("!i", proc.stdout.read(4))  # what Spark reads: the daemon is serving
    assert 0 < port < 65536
    return proc


def _torch_loaded(pid: int) -> bool:
    return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps())


def _stop(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """Close stdin, as Spark does to stop its daemon; the exit code and how long the exit took."""
    assert proc.stdin is not None
    start = time.monotonic()
    proc.stdin.close()
    code = proc.wait(timeout=30)
    return code, time.monotonic() - start


def test_with_the_preload_the_daemon_serves_with_torch_loaded_and_ends_as_pysparks_own():
    ours = _start(DAEMON_MODULE, **{PRELOAD_ENV: "1"})
    try:
        assert _torch_loaded(ours.pid)  # each worker it forks starts with it
    finally:
        code, _ = _stop(ours)
    theirs = _start("pyspark.daemon")
    their_code, _ = _stop(theirs)
    assert code == their_code  # the same exit code Spark gets from pyspark's own daemon


def test_without_the_preload_the_daemon_loads_no_torch():
    proc = _start(DAEMON_MODULE)
    try:
        assert not _torch_loaded(proc.pid)
    finally:
        _stop(proc)


@pytest.mark.parametrize("value", [None, "", "0", "yes"])
def test_only_the_value_1_preloads(monkeypatch, value):
    environ = {} if value is None else {PRELOAD_ENV: value}
    monkeypatch.setattr(daemon, "PRELOADED_MODULE", "no_module_should_be_imported_here")
    assert daemon.preload(environ) is False


def test_a_preload_that_fails_raises_and_freezes_nothing(monkeypatch):
    monkeypatch.setattr(daemon, "PRELOADED_MODULE", "airflow_provider_torchdist.no_such_module")
    frozen = gc.get_freeze_count()
    with pytest.raises(ModuleNotFoundError):
        daemon.preload({PRELOAD_ENV: "1"})
    assert gc.get_freeze_count() == frozen


def test_a_daemon_whose_preload_fails_says_so_and_serves_without_it(tmp_path):
    """A torch that cannot be imported: the daemon starts again, clean, and serves; the barrier
    task will report the import error itself."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    proc = _start(
        DAEMON_MODULE, **{PRELOAD_ENV: "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    )
    try:
        assert not _torch_loaded(proc.pid)
        assert "TORCHDIST_DAEMON_PRELOAD" not in psutil.Process(proc.pid).environ()
    finally:
        _stop(proc)
    assert proc.stderr is not None
    said = proc.stderr.read().decode()
    assert "could not load airflow_provider_torchdist.spark.node.launcher" in said
    assert "this torch is broken" in said
