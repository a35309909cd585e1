"""Where checkpoints are kept: a local directory, or any store fsspec reaches (``s3://``, ``gs://``,
``abfs://``, ...), with the same commit protocol on both.

A checkpoint is written whole under its step's prefix, then committed by its manifest, written last
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_manifest`). Nothing is renamed on a remote
store (S3 has no rename): each object is one upload (a PUT, or a multipart upload, which appears
only once completed), seen whole or not at all, and a reader trusts only steps whose manifest is
there and whose files match its size and SHA-256. Locally each file is written to a fresh private
name and renamed into place, and nothing another executor planted is followed
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_files`). The state streams through a
private temporary file both ways: a checkpoint is never held in memory whole here.

Credentials: the ranks use the executors' own (instance roles, workload identity) unless the task
sets ``checkpoint_conn_id``; its storage options then reach the ranks in
``TORCHDIST_CHECKPOINT_STORAGE_OPTIONS``, from the run's 0600 ``spec.json`` (as ``rank_env`` does),
never on a command line or in Spark's environment.

Imports fsspec (Airflow's and s3fs's dependency) only for a remote store; no Airflow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.node.checkpoint_files import (
    CHUNK,
    make_private_dir,
    open_regular,
    write_replacing,
)
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    MANIFEST,
    STATE,
    STEP_DIR,
    STORAGE_OPTIONS_ENV,
    Manifest,
    run_token,
    step_dir,
)

#: ``committed()``'s default: the checkpoints of every run.
ALL_RUNS: Any = object()
#: The most of a ``manifest.json`` that is read: a real one is a few hundred bytes, and anyone who
#: can write the store could plant one of gigabytes for every rank and task that lists it.
MAX_MANIFEST_BYTES = 1024 * 1024


class CheckpointStoreError(OSError):
    """A checkpoint's file that is not what its manifest says: changed after the commit."""


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


class CheckpointStore:
    """One run's checkpoint directory, local or remote.

    Example::

        store = CheckpointStore("s3://bucket/ckpt", {"key": ..., "secret": ...})
        store.commit(manifest, state_bytes)
        [m.step for m in store.committed()]
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

    @classmethod
    def from_env(cls, environ: Any = None) -> CheckpointStore | None:
        """The run's store (``TORCHDIST_CHECKPOINT_DIR``), or None when the run has none."""
        env = os.environ if environ is None else environ
        uri = env.get(CHECKPOINT_ENV)
        if not uri:
            return None
        options = json.loads(env.get(STORAGE_OPTIONS_ENV) or "{}")
        return cls(uri, options)

    def _join(self, *parts: str) -> str:
        return (
            "/".join([self.root.rstrip("/"), *parts])
            if self.fs is not None
            else os.path.join(self.root, *parts)
        )

    def uri_of(self, manifest: Manifest) -> str:
        """The checkpoint's URI: its step's prefix (``s3://bucket/ckpt/step-000000010-<run>``)."""
        return f"{self.uri}/{step_dir(manifest.step, manifest.run)}"

    # -- listing ---------------------------------------------------------------------------

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

    def committed(self, run: Any = ALL_RUNS) -> list[Manifest]:
        """Every committed checkpoint (only ``run``'s, when given: its manifests alone are read):
        steps with a readable manifest (a step without one was never committed, or is being
        written or deleted, and is not trusted)."""
        names = self._step_names()
        if run is not ALL_RUNS:
            names = [n for n in names if n.endswith("-" + run_token(run))]
        found = [m for m in map(self.manifest_of, names) if m is not None]
        return found if run is ALL_RUNS else [m for m in found if (m.run or None) == (run or None)]

    def manifest_of(self, name: str) -> Manifest | None:
        """The manifest of the step prefix ``name`` (``step-000000010-<run>``), or None when that
        step is not committed (no manifest, an unreadable one, or one copied from another step)."""
        try:
            if self.fs is None and not stat.S_ISDIR(os.lstat(self._join(name)).st_mode):
                return None  # a symlink planted at a step's name: reads and deletes would follow it
            manifest = Manifest.from_json(self._read(self._join(name, MANIFEST), MAX_MANIFEST_BYTES))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return manifest if step_dir(manifest.step, manifest.run) == name else None

    # -- writing ---------------------------------------------------------------------------

    def commit(self, manifest: Manifest, state: bytes | Callable[[BinaryIO], None]) -> Manifest:
        """Write the step's state (bytes, or what ``state(file)`` writes into an open file), then
        its manifest (the commit); returns the manifest written.

        The state goes to a private temporary file first (in the step's directory locally, renamed
        into place; else in the temp dir, then uploaded, multipart where it is big), so it is never
        held in memory whole here. A step written again (after a restart) is uncommitted only once
        its new state is ready. If ``state`` raises, nothing is committed or changed.
        """
        name = step_dir(manifest.step, manifest.run)
        write = state if callable(state) else (lambda out: out.write(state))
        if self.fs is None:
            self._make_step_dir(name)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{STATE}.", suffix=".tmp", dir=self._join(name) if self.fs is None else None
        )
        try:
            with os.fdopen(fd, "w+b") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
                out.seek(0)
                manifest = Manifest(**{**manifest.__dict__, "files": {STATE: digest(out)}})
            self._remove(self._join(name, MANIFEST))
            if self.fs is None:
                os.replace(tmp, self._join(name, STATE))
            else:
                self.fs.put_file(tmp, self._join(name, STATE))  # readers see the whole object or none
        except BaseException:
            if self.fs is None:
                with contextlib.suppress(OSError):  # a step of its own, now empty: not left behind
                    os.unlink(tmp)
                    os.rmdir(self._join(name))
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._write(self._join(name, MANIFEST), manifest.to_json().encode())
        return manifest

    def rewrite_manifest(self, manifest: Manifest) -> None:
        """Replace a committed checkpoint's manifest (to record that its run finished)."""
        self._write(self._join(step_dir(manifest.step, manifest.run), MANIFEST), manifest.to_json().encode())

    def delete(self, manifest: Manifest) -> None:
        """Uncommit (the manifest goes first), then remove the step's files."""
        name = step_dir(manifest.step, manifest.run)
        self._remove(self._join(name, MANIFEST))
        self._remove(self._join(name, STATE))
        if self.fs is None:
            try:
                os.rmdir(self._join(name))
            except OSError:
                pass  # something else in it: left as it is

    @contextmanager
    def open_state(self, manifest: Manifest) -> Iterator[BinaryIO]:
        """The checkpoint's state as an open file, checked against its manifest first (a torn or
        swapped file fails); a remote one is copied to a private temporary file as it streams in."""
        path = self._join(step_dir(manifest.step, manifest.run), STATE)
        with self._open(path) as source:
            expected = manifest.files.get(STATE) or {}
            if digest(source) != {"bytes": expected.get("bytes"), "sha256": expected.get("sha256")}:
                raise CheckpointStoreError(
                    f"{path} does not match its manifest (size or SHA-256): it was changed after the commit"
                )
            source.seek(0)
            yield source

    def read_state(self, manifest: Manifest) -> bytes:
        """The checkpoint's state, checked against its manifest (see :meth:`open_state`)."""
        with self.open_state(manifest) as source:
            return source.read()

    def probe(self) -> None:
        """Write and delete one small object: the store is reachable and writable (or this raises)."""
        name = f".torchdist-write-test-{os.getpid()}-{os.urandom(4).hex()}"
        if self.fs is None:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._write(self._join(name), b"probe")
        self._remove(self._join(name))

    # -- files -----------------------------------------------------------------------------

    def _make_step_dir(self, name: str) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        make_private_dir(self._join(name))

    def _write(self, path: str, data: bytes) -> None:
        if self.fs is not None:
            self.fs.pipe_file(path, data)  # one PUT: readers see all of it or nothing
        else:
            write_replacing(path, data)

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

    def _remove(self, path: str) -> None:
        try:
            if self.fs is not None:
                self.fs.rm_file(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
