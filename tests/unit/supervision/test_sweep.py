"""sweep_stale: only this user's run directories of dead processes go; live and in-process runs stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from airflow_provider_torchdist.supervision.sweep import (
    ADDRESS_FILE,
    STALE_AFTER_S,
    SUPERVISOR_FILE,
    is_stale,
    process_start_ticks,
    sweep_stale,
)
from tests.unit.conftest import wait_until


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def staging(
    base: Path,
    name: str,
    *,
    addr_pid: int | None = None,
    config_age: float | None = None,
    start_ticks: int | None = None,
) -> Path:
    path = base / name
    path.mkdir()
    (path / "spec.json").write_text("{}")
    if addr_pid is not None:
        address = {"host": "127.0.0.1", "port": 1, "pid": addr_pid}
        if start_ticks is not None:
            address["start_ticks"] = start_ticks
        (path / ADDRESS_FILE).write_text(json.dumps(address))
    if config_age is not None:
        config = path / SUPERVISOR_FILE
        config.write_text("{}")
        old = time.time() - config_age
        os.utime(config, (old, old))
    return path


def test_a_dead_supervisors_staging_dir_goes_and_a_live_ones_stays(tmp_path, dead_pid):
    dead = staging(tmp_path, "torchdist-dead", addr_pid=dead_pid, config_age=1)
    # This test process is alive, but not a supervisor: its PID in an address is a recycled one.
    recycled = staging(tmp_path, "torchdist-recycled", addr_pid=os.getpid(), config_age=1)
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "airflow_provider_torchdist.supervision.supervisor",
        ]
    )
    try:
        live = staging(tmp_path, "torchdist-live", addr_pid=supervisor.pid, config_age=STALE_AFTER_S * 2)
        assert sorted(sweep_stale(tmp_path)) == sorted([dead, recycled])
        assert live.is_dir()
    finally:
        supervisor.kill()
        supervisor.wait()


def test_a_supervisor_is_known_by_its_start_time_whatever_its_command_line(tmp_path, dead_pid):
    """A forked supervisor's command line is its title, or the task's where a title does not fit:
    the start time in its address tells it from a recycled PID instead."""
    me = process_start_ticks(os.getpid())  # this process's command line names no supervisor
    assert me is not None and me > 0
    live = staging(tmp_path, "torchdist-live", addr_pid=os.getpid(), config_age=1, start_ticks=me)
    recycled = staging(
        tmp_path, "torchdist-recycled", addr_pid=os.getpid(), config_age=1, start_ticks=me - 500
    )
    dead = staging(tmp_path, "torchdist-dead", addr_pid=dead_pid, config_age=1, start_ticks=me)
    assert sorted(sweep_stale(tmp_path)) == sorted([recycled, dead])
    assert live.is_dir()


def test_start_ticks_are_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    """The kernel's command name is field 2, in parentheses, and may hold both."""
    name = tmp_path / "a) b (c"
    name.write_text("import sys, time; print('up', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, str(name)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None and ticks >= process_start_ticks(os.getpid())
        assert psutil.Process(proc.pid).create_time() >= psutil.Process().create_time()
    finally:
        proc.kill()
        proc.wait()
    assert process_start_ticks(proc.pid) is None  # gone


def test_a_supervised_dir_without_an_address_goes_only_when_old(tmp_path):
    old = staging(tmp_path, "torchdist-old", config_age=STALE_AFTER_S + 60)
    young = staging(tmp_path, "torchdist-young", config_age=60)
    assert sweep_stale(tmp_path) == [old]
    assert young.is_dir()
    # ... measured against ``now``.
    assert sweep_stale(tmp_path, now=time.time() + STALE_AFTER_S) == [young]


def test_an_in_process_runs_staging_dir_is_never_swept(tmp_path):
    """hook.run() stages without a supervisor and may train for hours: nothing tells it is dead."""
    in_process = staging(tmp_path, "torchdist-inproc")
    os.utime(in_process, (0, 0))
    assert sweep_stale(tmp_path, now=time.time() + 10 * STALE_AFTER_S) == []
    assert in_process.is_dir()


def test_agent_dirs_go_when_their_process_is_dead(tmp_path, dead_pid):
    dead = tmp_path / f"torchdist-agent-{dead_pid}-abc"
    live = tmp_path / f"torchdist-agent-{os.getpid()}-abc"
    legacy = tmp_path / "torchdist-agent-k2j3h4"  # before the PID was in the name: left alone
    for path in (dead, live, legacy):
        path.mkdir()
        (path / "attempt_0").mkdir()
    assert sweep_stale(tmp_path) == [dead]
    assert live.is_dir() and legacy.is_dir()


@pytest.mark.parametrize("kind", ["data", "connect", "staging", "sharded"])
def test_a_nodes_data_dirs_go_when_their_process_is_dead(tmp_path, dead_pid, kind):
    dead = tmp_path / f"torchdist-{kind}-{dead_pid}-abc"
    live = tmp_path / f"torchdist-{kind}-{os.getpid()}-abc"
    for path in (dead, live):
        path.mkdir()
        (path / "rank-0.arrow").write_bytes(b"x")
    assert sweep_stale(tmp_path) == [dead]
    assert live.is_dir()


def test_symlinks_files_and_other_names_are_left_alone(tmp_path, dead_pid):
    target = staging(tmp_path, "elsewhere", addr_pid=dead_pid)
    (tmp_path / "torchdist-link").symlink_to(target)
    (tmp_path / f"torchdist-agent-{dead_pid}-link").symlink_to(target)
    (tmp_path / "torchdist-file").write_text("x")
    other = staging(tmp_path, "spark-dead", addr_pid=dead_pid)
    assert sweep_stale(tmp_path) == []
    assert target.is_dir() and other.is_dir() and (tmp_path / "torchdist-file").exists()


def test_an_unreadable_address_falls_back_to_the_age_rule(tmp_path):
    young = staging(tmp_path, "torchdist-garbled", config_age=1)
    (young / ADDRESS_FILE).write_text("{not json")
    assert not is_stale(young)
    assert is_stale(young, now=time.time() + STALE_AFTER_S + 1)


def test_several_bases_are_swept_once_each(tmp_path, dead_pid):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    in_a = staging(a, "torchdist-x", addr_pid=dead_pid)
    in_b = staging(b, f"torchdist-agent-{dead_pid}-y")
    assert sorted(sweep_stale([a, b, a, tmp_path / "missing"])) == sorted([in_a, in_b])


#: A real torchrun agent (node 0 of 2, whose peer never comes): it waits in the rendezvous with its
#: log directory made, until it is killed.
WAITING_AGENT = """
from airflow_provider_torchdist.spark.node.launcher import launch_node
from airflow_provider_torchdist.spark.node.network import free_port
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

spec = JobSpec(kind="callable", entry="p", num_processes=2, run_id="r", token="t", rendezvous_timeout=300)
master = ("127.0.0.1", free_port("127.0.0.1"))
launch_node(spec, node_rank=0, entry_path="/x", channel_address=("127.0.0.1", 1), host="127.0.0.1",
            master=master, node_key=bytes(32))
"""


def start_agent(temp_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(temp_dir)}
    return subprocess.Popen([sys.executable, "-c", WAITING_AGENT], env=env, cwd=Path(__file__).parents[3])


def agent_dirs(temp_dir: Path, agent: subprocess.Popen) -> list[Path]:
    return list(temp_dir.glob(f"torchdist-agent-{agent.pid}-*"))


@pytest.fixture
def killed_agents_dir(tmp_path: Path) -> Path:
    """The log directory of a real torchrun agent that was SIGKILLed (its ``finally`` never ran)."""
    agent = start_agent(tmp_path)
    try:
        wait_until(lambda: agent_dirs(tmp_path, agent), 120, "the agent's log dir")
    finally:
        agent.kill()
        agent.wait()
    [left] = agent_dirs(tmp_path, agent)
    return left


def test_a_sigkilled_agents_dir_goes_in_the_airflow_workers_sweep(killed_agents_dir: Path) -> None:
    assert sweep_stale(killed_agents_dir.parent) == [killed_agents_dir]


def test_a_sigkilled_agents_dir_goes_when_the_next_agent_on_its_host_starts(killed_agents_dir: Path) -> None:
    """An executor's host has no supervisor: the next node's agent there removes it."""
    temp_dir = killed_agents_dir.parent
    agent = start_agent(temp_dir)
    try:
        wait_until(lambda: agent_dirs(temp_dir, agent), 120, "the next agent's log dir")
        assert not killed_agents_dir.exists()  # removed before the new one was made
        [made] = agent_dirs(temp_dir, agent)
        assert made.stat().st_mode & 0o777 == 0o700
    finally:
        agent.kill()
        agent.wait()
