"""Remove what dead runs left in the temp directory: staging directories and torchrun agents' logs.

A run's supervisor removes its staging directory when it tears the run down, and a torchrun agent
its log directory when it returns. A process killed with SIGKILL (or a machine that lost power)
does neither. Each supervisor therefore sweeps at start, removing only what provably belongs to a
dead process of this user:

- ``torchdist-<random>`` staging directories of supervised runs: those whose supervisor (the
  ``pid`` of ``supervisor.addr``, the same process if it started at ``start_ticks``) is dead, and those without ``supervisor.addr`` whose
  ``supervisor.json`` is older than ``STALE_AFTER_S`` (the supervisor died before it listened; the
  task waits for that one minute at most). A staging directory without ``supervisor.json`` is an
  in-process run's (``hook.run()``), which may train for hours with nothing to tell it is alive:
  it is never touched.
- ``torchdist-agent-<pid>-<random>`` directories whose agent process ``pid`` is dead, and
  ``torchdist-data-<pid>-<random>`` ones (a node's ``train_data`` shards) and
  ``torchdist-connect-<pid>-<random>`` ones (a Connect node's payload) whose task's is, and
  ``torchdist-staging-<pid>-<random>`` and ``torchdist-sharded-<pid>-<random>`` ones (a rank's
  sharded checkpoint, saved or restored) whose rank's is. On the executors' hosts, the next
  node's process removes them (``spark.wire.private_files``).

Only real directories (no symlinks) owned by this user are considered. Example::

    removed = sweep_stale([Path(tempfile.gettempdir()), Path("/data/staging")])
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from airflow_provider_torchdist.spark.wire.private_files import AGENT_DIR_PREFIX, NODE_DIR_PREFIXES
from airflow_provider_torchdist.supervision.processes import command_line, is_alive

#: In a supervised run's staging directory: the supervisor's settings, written by the task before
#: the supervisor starts (so a staging directory that has it is a supervised run's).
SUPERVISOR_FILE = "supervisor.json"
#: ... and ``{"host", "port", "pid", "start_ticks"}``, written by the supervisor once its lifeline
#: listens (``start_ticks``: when its process started, :func:`process_start_ticks`; a live ``pid``
#: that started at another time is a recycled PID).
ADDRESS_FILE = "supervisor.addr"
#: The supervisor's module (a supervisor started as a new interpreter runs it), and the title of a
#: forked one: an address without ``start_ticks`` whose live ``pid`` names neither is a recycled PID.
SUPERVISOR_MODULE = "airflow_provider_torchdist.supervision.supervisor"
SUPERVISOR_TITLE = "torchdist supervisor"
#: Where the supervisor's module was in earlier releases: a run started by one, still live
#: after an upgrade, is still recognised (its directory is not stale).
EARLIER_SUPERVISOR_MODULES = ("airflow_provider_torchdist.supervisor ",)
#: A supervised staging directory without an address this old is a supervisor that died starting.
STALE_AFTER_S = 600.0
STAGING_PREFIX = "torchdist-"
AGENT_PREFIX = AGENT_DIR_PREFIX
#: The private directories of a node's processes (``private_files.private_directory``): a torchrun
#: agent's logs, a node's ``train_data`` shards, a Connect node's payload, a rank's sharded
#: checkpoint staged or fetched; named with their PID.
_AGENT_DIR = re.compile("(?:" + "|".join(map(re.escape, NODE_DIR_PREFIXES)) + r")(\d+)-.+")


def sweep_stale(
    bases: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | None = None,
    *,
    now: float | None = None,
) -> list[Path]:
    """Remove this user's stale run directories directly in ``bases`` (default: the temp
    directory); returns what was removed. Never raises for a directory it cannot read or remove."""
    if bases is None:
        bases = [tempfile.gettempdir()]
    elif isinstance(bases, (str, os.PathLike)):
        bases = [bases]
    now = time.time() if now is None else now
    uid = os.getuid()
    removed: list[Path] = []
    seen: set[str] = set()
    for base in bases:
        real = os.path.realpath(base)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = [e for e in os.scandir(real) if e.name.startswith(STAGING_PREFIX)]
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            path = Path(real, entry.name)
            if is_stale(path, now):
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.lexists(path):
                    removed.append(path)
    return removed


def is_stale(path: Path, now: float | None = None) -> bool:
    """Whether the run directory ``path`` (a staging or agent directory) belongs to a dead process."""
    now = time.time() if now is None else now
    name = path.name
    agent = _AGENT_DIR.fullmatch(name)
    if agent:
        return not is_alive(int(agent.group(1)))
    if name.startswith(AGENT_PREFIX):
        return False  # an agent directory of an older version: nothing tells whether it is live
    address = _supervisor_address(path / ADDRESS_FILE)
    if address is not None:
        return not _supervisor_alive(*address)
    try:
        config = os.lstat(path / SUPERVISOR_FILE)
    except OSError:
        return False  # an in-process run's, or not a run's at all
    return stat.S_ISREG(config.st_mode) and now - config.st_mtime > STALE_AFTER_S


def _supervisor_address(address: Path) -> tuple[int, int | None] | None:
    """The ``pid`` and ``start_ticks`` of a supervisor's address file (None: none, or unreadable)."""
    try:
        fd = os.open(address, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            data = json.load(f)
        pid, ticks = data.get("pid"), data.get("start_ticks")
    except (OSError, ValueError, AttributeError):
        return None
    if type(pid) is not int or pid <= 0:
        return None
    return pid, ticks if type(ticks) is int else None


def process_start_ticks(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``, field 22):
    fixed for the process's life, whatever the wall clock does (psutil's ``create_time`` adds the
    boot time, which moves when the clock is stepped). None where there is no ``/proc``, or the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        # The command name (field 2) may hold spaces and parentheses: the fields after it follow
        # its last ')'; the start time is the 20th of them.
        return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _supervisor_alive(pid: int, start_ticks: int | None) -> bool:
    if not is_alive(pid):
        return False
    if start_ticks is not None and (now := process_start_ticks(pid)) is not None:
        return now == start_ticks  # the same process, whatever its command line shows
    cmd = command_line(pid)
    # An unreadable command line is taken for the supervisor: never remove a live run's directory.
    markers = (SUPERVISOR_MODULE, SUPERVISOR_TITLE, *EARLIER_SUPERVISOR_MODULES)
    return not cmd or any(marker in cmd for marker in markers)
