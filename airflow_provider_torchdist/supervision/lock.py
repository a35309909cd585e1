"""The run lock: one live run per checkpoint directory.

The supervisor takes ``<checkpoint_dir>/.torchdist-run.lock`` (``flock``) before it starts the run
and holds it for its whole life, so a second live run of the same task fails at once
(:class:`~airflow_provider_torchdist.supervision.config.RunLocked`, exit code 3) instead of training
beside the first and writing the same checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from airflow_provider_torchdist.supervision.config import LOCK_FILE, RunLocked, SupervisorStartError


class RunLock:
    """``<checkpoint_dir>/.torchdist-run.lock``, held (``flock``) for the supervisor's life.

    The file is never deleted: deleting it would let a second run lock a new file of the same name
    while the first still holds the old one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, checkpoint_dir: str) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the live run that holds it."""
        directory = _local_dir(checkpoint_dir)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            path = Path(directory) / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SupervisorStartError(
                f"cannot create the run lock in checkpoint_dir {checkpoint_dir!r}: {exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"another run of this task is live (it holds {path}, pid {holder}): two runs sharing "
                f"checkpoint_dir {checkpoint_dir!r} would train at once and write the same checkpoints. Let "
                f"that run end (or stop it: its supervisor is pid {holder}), then try again."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

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
