"""Local checkpoint files among entries others may have planted: every executor of a run can write
its checkpoint directory, so nothing here follows a symlink or opens a FIFO another process left.

Files are written to a fresh ``mkstemp`` name (``O_EXCL``: nothing planted at a predictable name is
written through) and renamed over their final name (the entry itself, never its target); they are
opened ``O_NOFOLLOW`` and must be regular files; a step's directory must be a directory of its own.
Standard library only.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

#: How much of a checkpoint's file is read or copied at a time.
CHUNK = 8 * 1024 * 1024


class CheckpointNotAFile(OSError):
    """A checkpoint's file (or its step's directory) is not a regular file (a directory) but a
    symlink, a FIFO, ... The checkpoint directory is writable from every executor, so such an entry
    could point rank 0's load or write at a file of someone else's, or hang it on a FIFO: it is
    never opened or followed."""


def make_private_dir(path: str) -> None:
    """Create ``path`` (0700) if missing; refuse it when it is not a directory of its own."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(path).st_mode):  # a symlink planted at the step's name
        raise CheckpointNotAFile(
            f"refused to write the checkpoint into {path}: it is not a directory of its own (a "
            "symlink?). Nothing was written; remove the entry."
        )


def write_replacing(path: str, data: bytes) -> None:
    """Write ``data`` to a new private file beside ``path``, synced, then renamed over ``path``."""
    _replacing(path, lambda out: out.write(data))


def copy_replacing(local: str, path: str) -> None:
    """Copy the private local file ``local`` to a new private file beside ``path``, synced, then
    renamed over ``path`` (a rename across filesystems, which ``os.replace`` cannot do)."""

    def copy(out: BinaryIO) -> None:
        with open(local, "rb") as source:
            shutil.copyfileobj(source, out, CHUNK)

    _replacing(path, copy)


def _replacing(path: str, write: Callable[[BinaryIO], object]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextmanager
def open_regular(path: str) -> Iterator[BinaryIO]:
    """``path`` opened for reading, if it is a regular file itself (not a symlink to one).

    ``O_NOFOLLOW`` refuses a symlink at the name, ``O_NONBLOCK`` keeps a FIFO from blocking the open
    (no writer would ever come), and ``fstat`` of what was opened refuses all but a file.
    """
    what = "a symlink"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW's answer for a symlink
            raise
    else:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb") as source:
                yield source
            return
        os.close(fd)
        what = "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
    raise CheckpointNotAFile(
        f"refused to read {path}: it is {what}, not a file save_checkpoint wrote (every executor "
        "of the run can write the checkpoint directory, and such an entry could point the load at "
        "another file or hang it). Nothing was read; remove the entry."
    )
