"""The run lock: one live run per checkpoint directory.

The supervisor takes ``<checkpoint_dir>/.torchdist-run.lock`` (``flock``) before it starts the run
and holds it for its whole life, so a second live run of the same task fails at once
(:class:`~airflow_provider_torchdist.supervision.config.RunLocked`, exit code 3) instead of training
beside the first and writing the same checkpoints.

A run being torn down still holds the lock until its processes are gone, seconds after its
lifeline stopped answering (which is what a cleared task's new try waits for before it starts the
next run), and longer still when its ranks get a grace period to checkpoint. The holder says so
in the lock file, with the moment it will be gone (:meth:`RunLock.mark_ending`), and a new run
waits for such a lock until then instead of failing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from airflow_provider_torchdist.supervision.config import LOCK_FILE, RunLocked, SupervisorStartError

#: How long a new run waits for the lock of a run being torn down: its teardown ends spark-submit's
#: session (SIGTERM, then SIGKILL: about 10 s), and a loaded machine takes longer. Well inside the
#: task's wait for its supervisor to listen (``task_side.START_TIMEOUT_S``, 60 s), so that a wait
#: that ends in RunLocked is reported as such, not as a supervisor that never started.
ENDING_WAIT_S = 40.0
#: The longest wait for an ending holder that names a time: the longest grace period and the hard end.
MAX_ENDING_S = 3600 + ENDING_WAIT_S
#: What a run being torn down writes after its PID in the lock file.
ENDING = "ending"


class RunLock:
    """``<checkpoint_dir>/.torchdist-run.lock``, held (``flock``) for the supervisor's life.

    The file is never deleted: deleting it would let a second run lock a new file of the same name
    while the first still holds the old one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(
        cls,
        checkpoint_dir: str,
        ending_wait: float = ENDING_WAIT_S,
        on_wait: Callable[[float], None] | None = None,
    ) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the live run that holds it.

        A holder being torn down (:meth:`mark_ending`) is waited for: until the moment it said it
        would be gone (its ranks' grace period, then the hard end), or ``ending_wait`` seconds when
        it said none. ``on_wait`` hears that moment (seconds since the epoch) once, when the wait
        starts: the task that started this supervisor waits that much longer for it."""
        directory = _local_dir(checkpoint_dir)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            path = Path(directory) / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SupervisorStartError(
                f"cannot create the run lock in checkpoint_dir {checkpoint_dir!r}: {exc}"
            ) from None
        start = time.time()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").split()
                until = _ending_until(holder, start + ending_wait)
                if until is not None and time.time() < until:
                    if on_wait is not None and not announced:
                        on_wait(until)
                        announced = True
                    time.sleep(0.1)
                    continue
                os.close(fd)
                pid = holder[0] if holder else "unknown"
                still = f", still ending after {time.time() - start:.0f} s" if until is not None else ""
                raise RunLocked(
                    f"another run of this task is live (it holds {path}, pid {pid}{still}): two runs sharing "
                    f"checkpoint_dir {checkpoint_dir!r} would train at once and write the same checkpoints. Let "
                    f"that run end (or stop it: its supervisor is pid {pid}), then try again."
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def mark_ending(self, until: float | None = None) -> None:
        """Say in the lock file that this run is being torn down, gone by ``until`` (seconds since the
        epoch; None: within :data:`ENDING_WAIT_S`): the next run waits for the lock until then."""
        if self._fd < 0:
            return
        text = f"{os.getpid()} {ENDING}" + (f" {until:.0f}" if until is not None else "")
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{text}\n".encode(), 0)

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


def _ending_until(holder: list[str], default: float) -> float | None:
    """When a holder marked ending said it would be gone (``default`` when it said no time); None
    for a live holder. Its word is capped: a stop takes at most an hour's grace and the hard end."""
    if holder[1:2] != [ENDING]:
        return None
    try:
        said = float(holder[2]) if len(holder) > 2 else default
    except ValueError:
        said = default
    return min(said, time.time() + MAX_ENDING_S)


def _local_dir(checkpoint_dir: str) -> str:
    if "://" in checkpoint_dir:  # a file:/// URI: read as the task's checks read it
        from airflow_provider_torchdist.submit.validation import checkpoint_dir_path

        try:
            return checkpoint_dir_path(checkpoint_dir)
        except ValueError as exc:
            raise SupervisorStartError(str(exc)) from None
    if not os.path.isabs(checkpoint_dir):
        raise SupervisorStartError(f"checkpoint_dir {checkpoint_dir!r} is not an absolute path")
    return checkpoint_dir
