"""The run lock: one live run per checkpoint directory.

The supervisor takes ``<checkpoint_dir>/.torchdist-run.lock`` (``flock``) before it starts the run
and holds it for its whole life, so a second live run of the same task fails at once
(:class:`~airflow_provider_torchdist.supervision.config.RunLocked`, exit code 3) instead of training
beside the first and writing the same checkpoints.

A run being torn down still holds the lock until its processes are gone, seconds after its
lifeline stopped answering (which is what a cleared task's new try waits for before it starts the
next run). The holder says so in the lock file (:meth:`RunLock.mark_ending`), and a new run waits
for such a lock, up to :data:`ENDING_WAIT_S`, instead of failing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from airflow_provider_torchdist.supervision.config import LOCK_FILE, RunLocked, SupervisorStartError

#: How long a new run waits for the lock of a run being torn down: its teardown ends spark-submit's
#: session (SIGTERM, then SIGKILL: about 10 s), and a loaded machine takes longer. Well inside the
#: task's wait for its supervisor to listen (``task_side.START_TIMEOUT_S``, 60 s), so that a wait
#: that ends in RunLocked is reported as such, not as a supervisor that never started.
ENDING_WAIT_S = 40.0
#: What a run being torn down writes after its PID in the lock file.
ENDING = "ending"


class RunLock:
    """``<checkpoint_dir>/.torchdist-run.lock``, held (``flock``) for the supervisor's life.

    The file is never deleted: deleting it would let a second run lock a new file of the same name
    while the first still holds the old one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, checkpoint_dir: str, ending_wait: float = ENDING_WAIT_S) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the live run that holds it; a holder
        being torn down (:meth:`mark_ending`) is waited for, up to ``ending_wait`` seconds."""
        directory = _local_dir(checkpoint_dir)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            path = Path(directory) / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SupervisorStartError(
                f"cannot create the run lock in checkpoint_dir {checkpoint_dir!r}: {exc}"
            ) from None
        deadline = time.monotonic() + ending_wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").split()
                if holder[1:] == [ENDING] and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                os.close(fd)
                pid = holder[0] if holder else "unknown"
                still = f", still ending after {ending_wait:.0f} s" if holder[1:] == [ENDING] else ""
                raise RunLocked(
                    f"another run of this task is live (it holds {path}, pid {pid}{still}): two runs sharing "
                    f"checkpoint_dir {checkpoint_dir!r} would train at once and write the same checkpoints. Let "
                    f"that run end (or stop it: its supervisor is pid {pid}), then try again."
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def mark_ending(self) -> None:
        """Say in the lock file that this run is being torn down: the next run waits for the lock."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()} {ENDING}\n".encode(), 0)

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


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
