"""The object operations a checkpoint store is made of, on a local directory or any store fsspec
reaches (``s3://``, ``gs://``, ``abfs://``, ...): write an object whole, read at most so much of
one, open one, remove one, list the step prefixes.

Nothing is renamed on a remote store (S3 has no rename): each object is one upload (a PUT, or a
multipart upload, which appears only once completed), seen whole or not at all. Locally each file
is written to a fresh private name and renamed into place, and nothing another executor planted is
followed (:mod:`~airflow_provider_torchdist.spark.node.checkpoint_files`).

Imports fsspec (Airflow's and s3fs's dependency) only for a remote store; no Airflow.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.node.checkpoint_files import (
    CHUNK,
    make_private_dir,
    open_regular,
    write_replacing,
)
from airflow_provider_torchdist.spark.node.checkpoint_manifest import STEP_DIR


def local_path(uri: str) -> str | None:
    """The local path ``uri`` names (a plain path or ``file://`` URI), or None for a remote store."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    return rest if scheme.lower() == "file" else None


def digest(source: BinaryIO) -> dict[str, Any]:
    """What a manifest records of one file (read from where ``source`` is to its end): its size
    and SHA-256."""
    sha, size = hashlib.sha256(), 0
    while chunk := source.read(CHUNK):
        sha.update(chunk)
        size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


class HashingWriter:
    """A file open for writing that hashes what is written as it goes: the SHA-256 a manifest
    records, without reading a checkpoint back once more. Anything but ``write`` goes to the file.
    A write anywhere but at the end (a writer that seeks back) makes :attr:`sequential` false, and
    the caller hashes the file instead."""

    def __init__(self, out: BinaryIO) -> None:
        self._out, self._sha, self.size, self.sequential = out, hashlib.sha256(), 0, True

    def write(self, data: Any) -> int:
        if self.sequential and self._out.tell() != self.size:
            self.sequential = False
        written = self._out.write(data)
        if self.sequential:
            view = memoryview(data).cast("B")
            self._sha.update(view[:written])
            self.size += written
        return written

    def digest(self) -> dict[str, Any]:
        """What :func:`digest` would say of the file written."""
        return {"bytes": self.size, "sha256": self._sha.hexdigest()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


class StoreObjects:
    """A checkpoint directory's objects, local or remote: what :class:`CheckpointStore` is built on.

    ``uri``: a path or an fsspec URI; ``storage_options``: fsspec's (credentials, endpoint).
    """

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = uri.rstrip("/") or uri
        self.storage_options = dict(storage_options or {})
        self.path = local_path(self.uri)
        self.fs: Any = None
        if self.path is None:
            import fsspec

            # A fresh instance: fsspec caches instances and their listings, and other processes
            # (the other ranks, the task) change the store between two calls.
            self.fs, self.root = fsspec.core.url_to_fs(
                self.uri, skip_instance_cache=True, **self.storage_options
            )
            self.root = self.root.rstrip("/")
        else:
            self.root = self.path.rstrip("/") or "/"

    def _join(self, *parts: str) -> str:
        return (
            "/".join([self.root.rstrip("/"), *parts])
            if self.fs is not None
            else os.path.join(self.root, *parts)
        )

    # Public for the store's other users (a rank's position, resume_position): the same operations.

    def join(self, *parts: str) -> str:
        """The path of ``parts`` under the store's root."""
        return self._join(*parts)

    def write_whole(self, path: str, data: bytes) -> None:
        """Write the object at ``path`` whole (one PUT; locally a private file renamed into place)."""
        self._write(path, data)

    def read_at_most(self, path: str, most: int) -> bytes:
        """The object at ``path``; ``ValueError`` when it holds more than ``most`` bytes."""
        return self._read(path, most)

    def remove(self, path: str) -> None:
        """Remove the object at ``path`` (gone already: nothing to do)."""
        self._remove(path)

    def _step_names(self) -> list[str]:
        if self.fs is None:
            try:
                return [n for n in os.listdir(self.root) if STEP_DIR.match(n)]
            except FileNotFoundError:
                return []
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [name for name in (p.rstrip("/").rsplit("/", 1)[-1] for p in found) if STEP_DIR.match(name)]

    def probe(self) -> None:
        """Write and delete one small object: the store is reachable and writable (or this raises)."""
        name = f".torchdist-write-test-{os.getpid()}-{os.urandom(4).hex()}"
        if self.fs is None:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._write(self._join(name), b"probe")
        self._remove(self._join(name))

    def _make_step_dir(self, name: str) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        make_private_dir(self._join(name))

    def _write(self, path: str, data: bytes) -> None:
        if self.fs is not None:
            self.fs.pipe_file(path, data)  # one PUT: readers see all of it or nothing
        else:
            write_replacing(path, data)

    def _put(self, local: str, path: str) -> None:
        """Place the finished local file ``local`` at ``path``: renamed locally, uploaded remotely
        (readers see the whole object or none)."""
        if self.fs is None:
            os.replace(local, path)
        else:
            self.fs.put_file(local, path)

    def _read(self, path: str, most: int) -> bytes:
        """The object at ``path``; ``ValueError`` when it holds more than ``most`` bytes (only
        ``most`` + 1 of them are read)."""
        if self.fs is not None:
            data = self.fs.cat_file(path, start=0, end=most + 1)
        else:
            with open_regular(path) as source:
                data = source.read(most + 1)
        if len(data) > most:
            raise ValueError(f"{path} holds more than {most} bytes")
        return data

    @contextmanager
    def _open(self, path: str) -> Iterator[BinaryIO]:
        if self.fs is None:
            with open_regular(path) as source:
                yield source
            return
        with tempfile.TemporaryFile() as local, self.fs.open(path, "rb") as remote:
            shutil.copyfileobj(remote, local, CHUNK)
            local.seek(0)
            yield local

    @contextmanager
    def _stream(self, path: str) -> Iterator[BinaryIO]:
        """The object at ``path`` open for one sequential read (remote: streamed, not copied first)."""
        if self.fs is None:
            with open_regular(path) as source:
                yield source
            return
        with self.fs.open(path, "rb") as remote:
            yield remote

    def _remove(self, path: str) -> None:
        try:
            if self.fs is not None:
                self.fs.rm_file(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
