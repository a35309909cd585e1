"""forked: the supervisor as a fork of the task's process, checked on real forks of this process.

What each test asks of the child is written by the child itself into a file, then read here: the
child's own view (its session, its signal handlers, its descriptors) is what matters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from airflow_provider_torchdist.supervision.forked import (
    EXIT_CRASHED,
    ForkedProcess,
    can_fork,
    fork_detached,
    title_of,
)
from airflow_provider_torchdist.supervision.launch import start_mode
from airflow_provider_torchdist.supervision.processes import end_session, is_alive

pytestmark = pytest.mark.skipif(not can_fork(), reason="supervisors are forked on Linux only")


def _fork(tmp_path: Path, main: Callable[[], int]) -> ForkedProcess:
    return fork_detached(main, log=tmp_path / "supervisor.log", title=title_of(tmp_path / "staging"))


def _write(path: Path, data: object) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    os.replace(path.with_suffix(".tmp"), path)


def _wait_for(path: Path, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"the child never wrote {path}"
        time.sleep(0.01)
    return json.loads(path.read_text())


def test_the_child_leads_its_own_session_and_its_code_comes_back(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"

    def main() -> int:
        _write(seen, {"pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid()})
        return 5

    child = _fork(tmp_path, main)
    assert child.wait(20) == 5
    assert _wait_for(seen) == {"pid": child.pid, "sid": child.pid, "ppid": os.getpid()}
    assert not is_alive(child.pid)  # collected: no zombie left in this process


def test_the_child_holds_none_of_our_descriptors_and_writes_its_output_to_the_log(tmp_path: Path) -> None:
    """Airflow's supervisor sees the task's end as its sockets closing: a child that kept a copy of
    one would hold the task open. Here our end of a socket pair closes while the child lives, and
    the other end must see EOF at once."""
    ours, theirs = socket.socketpair()
    release = tmp_path / "release"

    def main() -> int:
        print("said on stdout")
        os.write(2, b"said on stderr\n")
        while not release.exists():
            time.sleep(0.01)
        return 0

    try:
        child = _fork(tmp_path, main)
        theirs.close()
        ours.settimeout(10)
        assert ours.recv(1) == b""  # EOF while the child still runs
        assert child.poll() is None
    finally:
        ours.close()
        release.touch()
    assert child.wait(20) == 0
    log = (tmp_path / "supervisor.log").read_text()
    assert "said on stdout" in log and "said on stderr" in log, log
    assert (tmp_path / "supervisor.log").stat().st_mode & 0o777 == 0o600


def test_the_child_has_default_signal_handlers_nothing_blocked_and_its_title(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"
    release = tmp_path / "release"

    def main() -> int:
        _write(
            seen,
            {
                "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
                "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            },
        )
        while not release.exists():
            time.sleep(0.01)
        return 0

    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        child = _fork(tmp_path, main)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
    try:
        assert _wait_for(seen) == {"sigterm_default": True, "sigusr1_default": True, "blocked": []}
        title = " ".join(psutil.Process(child.pid).cmdline()).strip()
        assert title == f"torchdist supervisor {tmp_path / 'staging'}"[: len(title)], title
        assert title.startswith("torchdist supervisor "), title
        # Its environment is as readable as ours: its title does not take the environment's room
        # (this process's is gone only if something here set a title before: Airflow's task runner).
        ours = psutil.Process().environ()
        assert psutil.Process(child.pid).environ().get("PATH") == ours.get("PATH")
    finally:
        release.touch()
    assert child.wait(20) == 0


def test_a_child_whose_function_raises_says_why_in_the_log_and_exits_with_its_code(tmp_path: Path) -> None:
    def main() -> int:
        raise RuntimeError("the supervisor could not start")

    child = _fork(tmp_path, main)
    assert child.wait(20) == EXIT_CRASHED
    assert "RuntimeError: the supervisor could not start" in (tmp_path / "supervisor.log").read_text()


def test_a_child_ended_by_a_signal_reports_it_and_its_session_can_be_ended(tmp_path: Path) -> None:
    def main() -> int:
        time.sleep(60)
        return 0

    child = _fork(tmp_path, main)
    try:
        deadline = time.monotonic() + 20
        while os.getsid(child.pid) != child.pid:  # until it has left ours for its own
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert child.poll() is None
        end_session(child.pid, grace=5.0)
        assert child.wait(20) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)


@pytest.mark.parametrize(("setting", "mode"), [(None, "fork"), ("exec", "exec"), (" Fork ", "fork")])
def test_supervisor_start_setting(monkeypatch: pytest.MonkeyPatch, setting: str | None, mode: str) -> None:
    if setting is None:
        monkeypatch.delenv("AIRFLOW__TORCHDIST__SUPERVISOR_START", raising=False)
    else:
        monkeypatch.setenv("AIRFLOW__TORCHDIST__SUPERVISOR_START", setting)
    assert start_mode() == mode


def test_an_unknown_supervisor_start_says_what_it_may_be(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHDIST__SUPERVISOR_START", "spawn")
    with pytest.raises(ValueError, match=r"supervisor_start must be one of fork, exec, not 'spawn'"):
        start_mode()
