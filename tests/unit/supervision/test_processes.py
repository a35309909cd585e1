"""processes: start a detached tree and end all of it, checked on real short-lived processes by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from airflow_provider_torchdist.supervision.processes import (
    command_line,
    end_processes,
    end_session,
    is_alive,
    session_members,
    start_detached,
)

# A leader that starts children in the three ways a Spark run does, then reports their PIDs:
# a plain child, one that moves to a process group of its own (like PySpark's daemon), and a
# grandchild under that one.
TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    plain = subprocess.Popen(["sleep", "60"])
    own_group = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"],
        process_group=0,
    )
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{plain.pid} {own_group.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(60)
    """
)

# Ignores SIGTERM, and says so once the handler is in place.
STUBBORN = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pathlib.Path(sys.argv[1]).write_text("ready")
    time.sleep(60)
    """
)


def wait_for(condition: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {condition}")
        time.sleep(0.02)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Popens a test starts; afterwards SIGKILL whatever is left of their sessions and reap them."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        for member in psutil.process_iter():
            try:
                if os.getsid(member.pid) == proc.pid:
                    member.kill()
            except (OSError, psutil.Error):
                pass
        proc.kill()
        proc.wait(timeout=10)


def start(started: list[subprocess.Popen[bytes]], code: str, *args: str, **kwargs) -> subprocess.Popen[bytes]:
    proc = start_detached([sys.executable, "-c", code, *args], **kwargs)
    started.append(proc)
    return proc


def test_start_detached_leads_a_new_session_without_our_stdin_or_descriptors(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    read_end, write_end = os.pipe()
    # A high number nothing in the child's own start-up would take.
    inheritable = os.dup2(write_end, 250, inheritable=True)
    try:
        code = textwrap.dedent(
            f"""
            import os, sys
            print("sid", os.getsid(0) == os.getpid(), "pgid", os.getpgid(0) == os.getpid())
            print("stdin", repr(sys.stdin.read()))
            try:
                os.fstat({inheritable})
                print("fd inherited")
            except OSError:
                print("fd closed")
            print("to stderr", file=sys.stderr)
            """
        )
        log = tmp_path / "out.log"
        log.write_text("earlier\n")
        proc = start(started, code, log=log, cwd=tmp_path, env={**os.environ, "MARK": "1"})
        assert proc.wait(timeout=30) == 0
    finally:
        for fd in (read_end, write_end, inheritable):
            os.close(fd)
    assert log.read_text().splitlines() == [
        "earlier",  # appended, not truncated
        "sid True pgid True",
        "stdin ''",
        "fd closed",
        "to stderr",
    ]


def test_end_session_ends_the_whole_tree_including_other_process_groups(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    pids_file = tmp_path / "pids"
    leader = start(started, TREE, str(pids_file))
    bystander = start(started, "import time; time.sleep(60)")  # another session: must survive
    wait_for(pids_file.exists)
    plain, own_group = map(int, pids_file.read_text().split())
    wait_for(lambda: len(session_members(leader.pid)) == 4)  # leader, plain, own_group, grandchild
    members = session_members(leader.pid)
    assert {leader.pid, plain, own_group} <= set(members)
    assert os.getpgid(own_group) == own_group != leader.pid  # its own group, same session
    assert "sleep 60" in command_line(plain)

    assert end_session(leader.pid, grace=5.0) == []

    assert [pid for pid in members if is_alive(pid)] == []
    assert session_members(leader.pid) == []
    assert is_alive(bystander.pid)
    # The leader is our child: left a zombie for its Popen, which still gets its exit status.
    assert leader.wait(timeout=10) == -signal.SIGTERM


def test_end_session_kills_what_ignores_sigterm_after_the_grace_period(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    ready = tmp_path / "ready"
    proc = start(started, STUBBORN, str(ready))
    wait_for(ready.exists)

    t0 = time.monotonic()
    assert end_session(proc.pid, grace=0.5) == []
    took = time.monotonic() - t0

    assert not is_alive(proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert 0.5 <= took < 5


def test_zombies_do_not_count(tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    # The leader starts a child that exits at once and is never collected: a zombie in the session.
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(
        """
        import os, pathlib, subprocess, sys, time
        child = subprocess.Popen(["true"])
        # Written whole, then renamed: the test must never read a half-written file.
        pathlib.Path(sys.argv[1] + ".tmp").write_text(str(child.pid))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(60)
        """
    )
    leader = start(started, code, str(pid_file))
    wait_for(pid_file.exists)
    zombie = int(pid_file.read_text())
    wait_for(lambda: psutil.Process(zombie).status() == psutil.STATUS_ZOMBIE)

    assert not is_alive(zombie)
    assert session_members(leader.pid) == [leader.pid]
    assert end_session(leader.pid, grace=5.0) == []


def test_end_processes_ends_exactly_the_given_pids(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    ready = tmp_path / "ready"
    stubborn = start(started, STUBBORN, str(ready))
    polite = start(started, "import time; time.sleep(60)")
    other = start(started, "import time; time.sleep(60)")
    wait_for(ready.exists)

    assert end_processes([stubborn.pid, polite.pid], grace=0.3, kill_wait=5.0) == []

    assert stubborn.wait(timeout=10) == -signal.SIGKILL
    assert polite.wait(timeout=10) == -signal.SIGTERM
    assert is_alive(other.pid)


def test_nothing_to_end() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not is_alive(gone.pid)
    assert command_line(gone.pid) == ""
    assert end_session(gone.pid, grace=0.1) == []
    assert end_processes([gone.pid, 0, -1], grace=0.1) == []
    # Session 0 is the kernel's threads, never ours; PID 0 is never alive.
    assert session_members(0) == []
    assert not is_alive(0)
    assert session_members() == []
