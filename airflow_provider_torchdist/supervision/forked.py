"""Start a detached process as a fork of this one: the run's supervisor, without a new interpreter.

A supervisor started as a new interpreter imports Airflow and the Spark provider again before it
can start spark-submit: 1.2-1.3 s of every operator run (``bench/profile_launch.py``, variant
``supervised``). The task's process has all of it imported already, so a fork of it starts with
everything loaded, in milliseconds. Airflow starts its own task processes the same way (a fork of
its supervisor, ``airflow.sdk.execution_time.supervisor``).

The child takes nothing of the task's but its memory:

- it leads a session of its own (``setsid``): its PID is its session id, as with
  :func:`~airflow_provider_torchdist.supervision.processes.start_detached`, and it outlives the task;
- every descriptor it inherited is pointed at /dev/null (stdout and stderr at its log): Airflow's
  supervisor sees the task's sockets close when the task ends, and nothing of the task's is read
  or written from here. The objects that held them stay referenced, so none closes a number this
  process has reused;
- standard streams of its own (the task's may have been locked by another thread at the fork);
- Python's signal handlers are back to their defaults, and no signal is blocked;
- Airflow's logging is written as text into its log;
- ``ps`` shows it as ``torchdist supervisor <staging>`` (its environment stays readable where the
  task's was);
- what it inherited is frozen out of the garbage collector (``gc.freeze``), so that a collection
  does not copy the task's heap page by page;
- it never returns into the task's code: it ends with ``os._exit``, running none of the task's
  ``atexit`` handlers.

Linux only (descriptors are listed from ``/proc/self/fd``): elsewhere the supervisor starts as a new
interpreter, as it does with ``[torchdist] supervisor_start = exec``.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from airflow_provider_torchdist.supervision.sweep import SUPERVISOR_TITLE

#: The exit code of a child whose function raised.
EXIT_CRASHED = 70
_FD_DIR = "/proc/self/fd"
#: The task's logging, kept referenced in the child (see the module docstring).
_INHERITED: list[Any] = []


def can_fork() -> bool:
    """Whether this platform starts supervisors by forking (see the module docstring)."""
    return sys.platform.startswith("linux") and os.path.isdir(_FD_DIR)


class ForkedProcess:
    """What the parent holds of a forked child: its PID, and its exit code once it ended (a thread
    collects it, so it never stays a zombie of a long-lived process). The part of
    ``subprocess.Popen`` that :func:`~airflow_provider_torchdist.supervision.task_side.start_supervisor`
    uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._collect, name=f"torchdist-reap-{pid}", daemon=True).start()

    def _collect(self) -> None:
        try:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # collected by someone else: its code is lost
            self.returncode = -1
        finally:
            self._ended.set()

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: until it ends); returns :meth:`poll`."""
        self._ended.wait(timeout)
        return self.poll()


def fork_detached(main: Callable[[], int], *, log: str | os.PathLike[str], title: str) -> ForkedProcess:
    """Fork; the child detaches (see the module docstring), runs ``main`` and exits with what it
    returns. Its stdout and stderr are appended to ``log`` (created 0600)."""
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        pid = os.fork()
    except BaseException:
        os.close(log_fd)
        raise
    if pid == 0:  # pragma: no cover (the child: measured by the tests of what it does)
        _child(main, log_fd, title)
    os.close(log_fd)
    return ForkedProcess(pid)


def _child(main: Callable[[], int], log_fd: int, title: str) -> NoReturn:  # pragma: no cover
    code = EXIT_CRASHED
    try:
        os.setsid()
        gc.freeze()
        _take_descriptors(log_fd)
        _new_streams()
        _reset_signals()
        _set_title(title)
        _log_as_text()
        code = main()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        try:
            # Nothing may interrupt the way out: an exception here would unwind into the task's code.
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(BaseException):
                    stream.flush()
        finally:
            os._exit(code)


def _take_descriptors(log_fd: int) -> None:
    """Point every inherited descriptor at /dev/null, and the standard output streams at the log.

    The descriptors stay open (``dup2`` over them), so the objects of the task's that hold them
    (sockets to Airflow's supervisor, its log channel, files) are left as they are; only what they
    reach changes."""
    # Above 2, whatever the task had closed: the standard descriptors are set from these.
    devnull = _above_2(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
    log_fd = _above_2(log_fd)
    outputs = {1, 2}
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            outputs.add(stream.fileno())  # type: ignore[union-attr]
    os.dup2(devnull, 0)
    for fd in sorted(int(name) for name in os.listdir(_FD_DIR)):
        if fd in (0, devnull, log_fd) or not _is_open(fd):  # (the listing's own, closed since)
            continue
        os.dup2(log_fd if fd in outputs else devnull, fd, inheritable=fd <= 2)
    for fd in (1, 2):  # even where the task had closed them
        os.dup2(log_fd, fd)
    os.close(devnull)
    os.close(log_fd)


def _above_2(fd: int) -> int:
    """``fd`` moved to a number above 2 (close-on-exec), if it is not there already."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _new_streams() -> None:
    """Standard streams of its own on descriptors 1 and 2: the task's objects may have been locked
    by another of its threads at the fork (a write in progress), and would stay locked here. They
    stay referenced, so that none closes its descriptor."""
    _INHERITED.extend([sys.stdout, sys.stderr])
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (for the process's life)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _reset_signals() -> None:
    """No Python handler of the task's stays (Airflow's, a test runner's): each is back to the
    default (an ignored signal stays ignored, as Python ignores SIGPIPE), and nothing is blocked."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


def _set_title(title: str) -> None:
    """``title`` as this process's command line. ``SPT_NOENV``: only the room the command line had
    is used, so ``/proc/<pid>/environ`` stays readable (a longer title is cut)."""
    os.environ["SPT_NOENV"] = "1"
    try:
        from setproctitle import setproctitle

        setproctitle(title)
    except Exception as exc:  # a cosmetic: never worth failing a run for
        print(f"the supervisor's process title was not set: {exc!r}", file=sys.stderr)
    finally:
        os.environ.pop("SPT_NOENV", None)


def _log_as_text() -> None:
    """Airflow's logging as text on stderr (the log), not as JSON into the task's log channel."""
    try:
        import structlog
        from airflow.sdk.log import configure_logging

        _INHERITED.append(structlog.get_config())
        configure_logging(output=sys.stderr, colored_console_log=False)
    except Exception as exc:  # the log loses the provider's lines; the owners still get them
        print(f"Airflow's logging was not set up for the supervisor: {exc!r}", file=sys.stderr)


def title_of(staging_dir: str | os.PathLike[str]) -> str:
    """The process title of the supervisor of ``staging_dir``."""
    return f"{SUPERVISOR_TITLE} {Path(staging_dir)}"
