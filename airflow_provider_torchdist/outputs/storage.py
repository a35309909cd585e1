"""Where large outputs are kept (``output_path``), and how a stored one is read back verified.

A stored output is moved (a rename) into ``output_path`` when that is a local directory on the
staging directory's filesystem, else copied there. Below the configured base every directory this
module makes is 0700 and every file 0600, and no symlink found there is followed: a link planted at
a run's directory or file name is refused (directories) or replaced (files), never written through.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

_COPY_CHUNK = 8 * 1024 * 1024


def local_path(dest: Any) -> Path | None:
    """The local filesystem path of an ``ObjectStoragePath``, or None for remote storage."""
    return Path(dest.path) if dest.protocol in ("", "file", "local") else None


@contextmanager
def private_dir(base: Path, parts: list[str]) -> Iterator[int]:
    """A descriptor of ``base/parts...``, made 0700 where missing, never through a symlink below ``base``."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise PermissionError(
                    f"Refusing to store an output under {base}: {part!r} there is not a plain directory "
                    f"(a symlink, or a file): {exc.strerror}. Remove it, or choose another output_path."
                ) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def same_filesystem(dir_fd: int, src: Path) -> bool:
    """Is the directory open at ``dir_fd`` on ``src``'s filesystem (so a rename can move it)?"""
    return os.fstat(dir_fd).st_dev == os.stat(src).st_dev


def store_local(src: Path, dest: Path, base: Path) -> None:
    """Put the file ``src`` at ``dest`` (below ``base``): a rename on one filesystem, else a private copy."""
    parts = list(dest.relative_to(base).parts)
    name = parts.pop()
    with private_dir(base, parts) as dir_fd:
        if same_filesystem(dir_fd, src):
            try:
                os.replace(src, name, dst_dir_fd=dir_fd)  # replaces a planted symlink, never follows it
                return
            except OSError:  # EXDEV behind a bind mount, or the like: copy instead
                pass
        tmp = f".{name}.{os.getpid()}.part"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            with open(src, "rb") as f, os.fdopen(out, "wb") as w:
                while chunk := f.read(_COPY_CHUNK):
                    w.write(chunk)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise


def store_remote(src: Path, dest: Any) -> None:
    """Stream ``src`` to an ``ObjectStoragePath`` on remote storage (s3://, gs://, ...)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f, dest.open("wb") as out:
        while chunk := f.read(_COPY_CHUNK):
            out.write(chunk)


def open_stored(dest: Any) -> BinaryIO:
    """Open a stored output for reading (a local one without following a symlink)."""
    local = local_path(dest)
    if local is None:
        return dest.open("rb")
    return os.fdopen(os.open(local, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0)


class VerifiedChunks:
    """A stored pickle read once into chunks, verified, then read by the unpickler chunk by chunk.

    Each chunk is let go as soon as the unpickler has consumed it, so the bytes and the object
    built from them are not both held whole: loading a 1 GB output peaks near 1 GB, not 2 GB.
    """

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = deque(chunks)
        self._pos = 0  # into the first chunk

    @classmethod
    def from_stream(
        cls, stream: BinaryIO, size: int, check: Callable[[str], None], refuse: Callable[[str], Exception]
    ) -> VerifiedChunks:
        """Read exactly ``size`` bytes, hashing them as they arrive; ``check(hexdigest)`` must pass
        before anything is returned. A stream of another length is refused with ``refuse(why)``."""
        chunks: list[bytes] = []
        digest = hashlib.sha256()
        got = 0
        while got < size:
            chunk = stream.read(min(_COPY_CHUNK, size - got))
            if not chunk:
                break
            digest.update(chunk)
            chunks.append(chunk)
            got += len(chunk)
        if got != size or stream.read(1):
            raise refuse(f"the stored file is not the {size} bytes that were signed")
        check(digest.hexdigest())
        return cls(chunks)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._chunks:
            chunk = self._chunks[0]
            n = min(len(out) - done, len(chunk) - self._pos)
            out[done : done + n] = memoryview(chunk)[self._pos : self._pos + n]
            done += n
            self._pos += n
            if self._pos == len(chunk):
                self._chunks.popleft()
                self._pos = 0
        return done

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = sum(len(c) for c in self._chunks) - self._pos
        out = bytearray(size)
        return bytes(out[: self.readinto(out)])

    def readline(self) -> bytes:
        line = bytearray()
        while self._chunks:
            chunk = self._chunks[0]
            end = chunk.find(b"\n", self._pos)
            stop = len(chunk) if end < 0 else end + 1
            line += chunk[self._pos : stop]
            self._pos = stop
            if self._pos == len(chunk):
                self._chunks.popleft()
                self._pos = 0
            if end >= 0:
                break
        return bytes(line)
