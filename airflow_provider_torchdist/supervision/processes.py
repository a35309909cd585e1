"""Start a process tree detached from us, and end all of it.

A tree started with ``start_new_session=True`` is one session whose id is the leader's PID. Every
process it forks stays in that session, even one that moves to a process group of its own (Spark's
Python daemon and its workers do), and the kernel never hands out a PID that is still some
session's id. So "the session" is the tree: it can be listed and ended without following parents,
which orphans lose when an intermediate process dies.

Example::

    daemon = start_detached(["sleep", "60"], log="daemon.log")
    ...
    end_session(daemon.pid, grace=5.0)  # SIGTERM, 5 s, SIGKILL: nothing of it is left

Processes are held as :class:`psutil.Process` between listing and signalling, so a PID the kernel
recycled meanwhile is never signalled. Zombies count as ended: they are left for their parent to
collect (collecting a child here would take its exit status from the ``Popen`` that waits on it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence

import psutil

#: How often the wait between SIGTERM and SIGKILL looks again.
_POLL_S = 0.05


def start_detached(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session: stdin from /dev/null, stdout and stderr
    appended to ``log`` (discarded if None), no inherited descriptors.

    Its PID is its session id, for :func:`session_members` and :func:`end_session`; it does not get
    the signals of our terminal, and it outlives us unless ended.
    """
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(cmd),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            close_fds=True,
            start_new_session=True,
        )
    finally:
        if not isinstance(out, int):
            out.close()  # the child holds its own copy


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    return pid > 0 and _alive(_process(pid))


def command_line(pid: int) -> str:
    """The command line of process ``pid``, space-separated ("" when it is gone or unreadable)."""
    proc = _process(pid) if pid > 0 else None
    try:
        return " ".join(proc.cmdline()) if proc is not None else ""
    except psutil.Error:
        return ""


def session_members(*sids: int) -> list[int]:
    """PIDs of the live processes (zombies excluded) in any of the sessions ``sids``, sorted.

    ``session_members(proc.pid)`` lists what is left of a process started with
    ``start_new_session=True`` and of everything it started.
    """
    return sorted(proc.pid for proc in _members(sids))


def end_session(sid: int, grace: float = 5.0) -> list[int]:
    """End every process of session ``sid``: SIGTERM, up to ``grace`` seconds for the session to
    empty, then SIGKILL what is there by then and up to ``grace`` seconds more.

    The session is listed again before each signal, so a process forked meanwhile is ended too.
    Nothing outside the session is signalled. Returns the PIDs still alive (normally none).
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        members = _members({sid})
        if not members:
            return []
        _send(members, sig)
        deadline = time.monotonic() + grace
        while _members({sid}) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return session_members(sid)


def end_processes(pids: Collection[int], grace: float = 5.0, kill_wait: float = 5.0) -> list[int]:
    """End exactly the processes ``pids``: SIGTERM, up to ``grace`` seconds, then SIGKILL the ones
    still alive and up to ``kill_wait`` seconds more. Returns the PIDs still alive (normally none).

    Unlike :func:`end_session` this never lists anything again: use it for a set gathered by other
    means (several sessions, a network namespace), and call it again to catch late forks.
    """
    procs = [proc for proc in (_process(pid) for pid in pids if pid > 0) if _alive(proc)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        _send(procs, sig)
        deadline = time.monotonic() + wait
        while True:
            procs = [proc for proc in procs if _alive(proc)]
            if not procs or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        if not procs:
            return []
    return sorted(proc.pid for proc in procs)


# -- internals ------------------------------------------------------------------------------------


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(proc: psutil.Process | None) -> bool:
    """Running, not a zombie, and still the process we looked up (not a recycled PID)."""
    if proc is None:
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _members(sids: Collection[int]) -> list[psutil.Process]:
    # Session 0 holds the kernel's threads: never a session of ours.
    wanted = {sid for sid in sids if sid > 0}
    if not wanted:
        return []
    found = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) not in wanted:
                continue
        except OSError:  # gone meanwhile
            continue
        proc = _process(pid)
        if proc is not None and _alive(proc):
            found.append(proc)
    return found


def _send(procs: Collection[psutil.Process | None], sig: signal.Signals) -> None:
    for proc in procs:
        if proc is None:
            continue
        try:
            proc.send_signal(sig)
        except psutil.Error:  # gone, recycled (never signalled), or not ours to signal
            pass
