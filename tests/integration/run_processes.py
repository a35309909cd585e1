"""Finding a run's processes from a test: the run supervisors, a run's process tree, and waiting for
it to be gone.

The integration suite runs in three pytest-xdist workers (``scripts/test``), and another run of the
suite may share the machine, so a machine-wide scan must keep to this worker's own processes. Each
worker marks its environment with ``TORCHDIST_TEST_OWNER`` (this session's id and the worker's name,
set by :func:`mark_this_worker` at start-up), and every process it starts inherits the mark, down to
Spark's executors and the ranks (Airflow's task processes, the supervisors and Spark Workers pass
their environment on). A scan keeps the processes that carry this worker's mark.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import pytest

SUPERVISOR_MODULE = "airflow_provider_torchdist.supervision.supervisor"
#: How a supervisor's command line shows: a forked one's title, or a new interpreter's module.
SUPERVISOR_MARKERS = ("torchdist supervisor ", SUPERVISOR_MODULE)
OWNER_VARIABLE = "TORCHDIST_TEST_OWNER"
#: Directories only this worker's runs use (a deployment's home, where its tasks stage their runs):
#: a process whose environment is unreadable is this worker's when its command line names one.
OWN_DIRECTORIES: list[str] = []


def is_supervisor(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a run supervisor (raises ``psutil.Error`` when it is gone)."""
    cmd = " ".join(proc.cmdline())
    return any(marker in cmd for marker in SUPERVISOR_MARKERS)


def staging_of(supervisor: psutil.Process) -> Path:
    """A supervisor's staging directory: the last word of its command line (a retitled process's
    command line is one string, padded with empty ones)."""
    return Path(" ".join(supervisor.cmdline()).split()[-1])


def mark_this_worker() -> None:
    """Give this process's environment its mark: in the controller (or a run without xdist) a new
    session id; in an xdist worker, which inherits the controller's, the session id and its name."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        os.environ[OWNER_VARIABLE] = uuid.uuid4().hex
    else:
        os.environ[OWNER_VARIABLE] = f"{os.environ.get(OWNER_VARIABLE, '')}/{worker}"


def of_this_worker(proc: psutil.Process) -> bool:
    """Whether ``proc`` was started by this pytest worker (it carries the worker's mark).

    A retitled process (Airflow's ``airflow worker -- ...``, and a supervisor forked from one) shows
    an empty environment: it is this worker's when it is this process's child (a supervisor forked
    here) or its command line names one of :data:`OWN_DIRECTORIES` (a deployment's supervisor names
    its staging directory, under the deployment's home).
    """
    try:
        try:
            environ = proc.environ()
        except psutil.AccessDenied:  # a non-dumpable process (Airflow's, and one forked from it)
            environ = {}
        if environ:
            return environ.get(OWNER_VARIABLE) == os.environ[OWNER_VARIABLE]
        cmd = " ".join(proc.cmdline())
        return proc.ppid() == os.getpid() or any(f"{d}{os.sep}" in cmd for d in OWN_DIRECTORIES)
    except (psutil.Error, OSError):
        return False


def supervisors() -> dict[int, psutil.Process]:
    """This worker's live run supervisors, by PID."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if is_supervisor(proc) and proc.status() != psutil.STATUS_ZOMBIE:
                if of_this_worker(proc):
                    found[proc.pid] = proc
        except psutil.Error:
            continue
    return found


@pytest.fixture
def no_supervisor_left() -> Iterator[None]:
    """The test ends with no run supervisor of its own left: one still there 30 s after the test is a
    leak (it would hold its run's Spark application and lock for ``reattach_timeout``). It is stopped
    by PID and the test errors."""
    before = set(supervisors())
    yield
    deadline = time.monotonic() + 30
    while (left := {pid: p for pid, p in supervisors().items() if pid not in before}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    # SIGTERM is the supervisor's own teardown (spark-submit, in a session of its own, goes too);
    # SIGKILL for one that does not end on it.
    for proc in left.values():
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, stuck = psutil.wait_procs(list(left.values()), timeout=20)
    for proc in stuck:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not left, f"run supervisors (pids {sorted(left)}) outlived the test by 30 s; stopped now"


def supervisor_above(pid: int) -> psutil.Process:
    """The run supervisor among ``pid``'s ancestors (``pid`` a rank of the run)."""
    proc = psutil.Process(pid)
    for candidate in [proc, *proc.parents()]:
        if is_supervisor(candidate):
            return candidate
    raise AssertionError(f"process {pid} has no run supervisor among its ancestors")


def run_tree(supervisor: psutil.Process, ranks: Iterable[int]) -> tuple[dict[int, str], Path]:
    """Every process of a run, ``{pid: command}``: the supervisor, everything under it, and the
    ``ranks`` (which torchrun may have moved out of the tree); and the run's staging directory (the
    supervisor's last argument)."""
    tree = {pid: f"rank process {pid}" for pid in ranks}
    for proc in [supervisor, *supervisor.children(recursive=True)]:
        try:
            tree[proc.pid] = " ".join(proc.cmdline())[:160]
        except psutil.Error:  # a short-lived child that has just exited
            continue
    return tree, staging_of(supervisor)


def alive(pids: dict[int, str]) -> dict[int, str]:
    """The entries of ``pids`` whose process still runs (a zombie does not)."""
    left = {}
    for pid, cmd in pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left[pid] = cmd
        except psutil.NoSuchProcess:
            pass
    return left


def wait_gone(tree: dict[int, str], staging: Path, since: float, limit: float, after: str) -> float:
    """Wait until every process of ``tree`` and ``staging`` are gone, at most ``limit`` s after
    ``since`` (``time.monotonic()``); returns when that was, in seconds after ``since``."""
    while alive(tree) or staging.exists():
        assert time.monotonic() - since < limit, (
            f"{limit:g} s after {after}: left {alive(tree)}, staging {'there' if staging.exists() else 'gone'}"
        )
        time.sleep(0.2)
    return time.monotonic() - since
