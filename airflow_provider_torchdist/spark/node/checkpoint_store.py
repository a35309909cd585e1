"""Where checkpoints are kept: a local directory, or any store fsspec reaches (``s3://``, ``gs://``,
``abfs://``, ...), with the same commit protocol on both.

A checkpoint is written whole under its step's prefix (one file, ``state.pt``, for
``save_checkpoint``; the files of a framework's checkpoint folder for the Lightning and Hugging
Face callbacks), then committed by its manifest, written last
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_manifest`). A reader trusts only steps
whose manifest is there and whose files match its sizes and SHA-256s; the object operations
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_io`) never rename on a remote store and
never follow what another executor planted locally. Every file streams through a private temporary
file both ways: a checkpoint is never held in memory whole here.

Credentials: the ranks use the executors' own (instance roles, workload identity) unless the task
sets ``checkpoint_conn_id``; its storage options then reach the ranks in
``TORCHDIST_CHECKPOINT_STORAGE_OPTIONS``, from the run's 0600 ``spec.json`` (as ``rank_env`` does),
never on a command line or in Spark's environment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.node.checkpoint_files import CHUNK, copy_replacing
from airflow_provider_torchdist.spark.node.checkpoint_io import (
    HashingWriter,
    StoreObjects,
    digest,
    local_path,
)
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    MANIFEST,
    STATE,
    STORAGE_OPTIONS_ENV,
    Manifest,
    checked_file_name,
    run_token,
    step_dir,
)
from airflow_provider_torchdist.spark.node.resume_position import delete_positions
from airflow_provider_torchdist.spark.wire.private_files import CHECKPOINT_STAGING_PREFIX, private_directory

__all__ = ["ALL_RUNS", "CheckpointStore", "CheckpointStoreError", "digest", "local_path"]

#: ``committed()``'s default: the checkpoints of every run.
ALL_RUNS: Any = object()
#: The most of a ``manifest.json`` that is read: a real one is a few hundred bytes, and anyone who
#: can write the store could plant one of gigabytes for every rank and task that lists it.
MAX_MANIFEST_BYTES = 1024 * 1024
#: One file's contents: bytes, or a function that writes them into an open file.
Contents = bytes | Callable[[BinaryIO], None]


class CheckpointStoreError(OSError):
    """A checkpoint's file that is not what its manifest says: changed after the commit."""


class CheckpointStore(StoreObjects):
    """One run's checkpoint directory, local or remote.

    Example::

        store = CheckpointStore("s3://bucket/ckpt", {"key": ..., "secret": ...})
        store.commit(manifest, state_bytes)
        [m.step for m in store.committed()]
    """

    @classmethod
    def from_env(cls, environ: Any = None) -> CheckpointStore | None:
        """The run's store (``TORCHDIST_CHECKPOINT_DIR``), or None when the run has none."""
        env = os.environ if environ is None else environ
        uri = env.get(CHECKPOINT_ENV)
        if not uri:
            return None
        options = json.loads(env.get(STORAGE_OPTIONS_ENV) or "{}")
        return cls(uri, options)

    def uri_of(self, manifest: Manifest) -> str:
        """The checkpoint's URI: its step's prefix (``s3://bucket/ckpt/step-000000010-<run>``)."""
        return f"{self.uri}/{step_dir(manifest.step, manifest.run)}"

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

    def commit(self, manifest: Manifest, state: Contents | Mapping[str, Contents]) -> Manifest:
        """Write the step's files, then its manifest (the commit); returns the manifest written.

        ``state``: the contents of ``state.pt`` (bytes, or what ``state(file)`` writes into an open
        file), or ``{file name: contents}`` for a checkpoint of several files (a framework's
        checkpoint folder). Each file goes to a private temporary file first (in the step's
        directory locally, renamed into place; else in the temp dir, then uploaded, multipart where
        it is big), so it is never held in memory whole here. A step written again (after a
        restart) is uncommitted only once all its new files are ready. If writing raises, nothing
        is committed or changed.
        """
        files = dict(state) if isinstance(state, Mapping) else {STATE: state}
        for file_name in files:
            checked_file_name(file_name)
        name = step_dir(manifest.step, manifest.run)
        if self.fs is None:
            self._make_step_dir(name)
        ready: dict[str, str] = {}
        recorded: dict[str, dict[str, Any]] = {}
        try:
            for file_name, contents in files.items():
                ready[file_name], recorded[file_name] = self._stage(name, file_name, contents)
            self._remove(self._join(name, MANIFEST))
            for file_name, tmp in ready.items():
                self._put(tmp, self._join(name, file_name))
        except BaseException:
            if self.fs is None:
                with contextlib.suppress(OSError):  # a step of its own, now empty: not left behind
                    os.rmdir(self._join(name))
            raise
        finally:
            for tmp in ready.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        manifest = Manifest(**{**manifest.__dict__, "files": recorded})
        self._write(self._join(name, MANIFEST), manifest.to_json().encode())
        return manifest

    def _stage(self, step: str, file_name: str, contents: Contents) -> tuple[str, dict[str, Any]]:
        """One file written to a private temporary file, synced: its path and what the manifest
        records of it."""
        write = contents if callable(contents) else (lambda out: out.write(contents))
        fd, tmp = tempfile.mkstemp(
            prefix=f".{file_name}.", suffix=".tmp", dir=self._join(step) if self.fs is None else None
        )
        try:
            with os.fdopen(fd, "w+b") as out:
                hashing = HashingWriter(out)
                write(hashing)  # type: ignore[arg-type]
                out.flush()
                os.fsync(out.fileno())
                if hashing.sequential:  # hashed as it was written (torch.save writes in order)
                    return tmp, hashing.digest()
                out.seek(0)
                return tmp, digest(out)
        except BaseException:
            os.unlink(tmp)
            raise

    def staging_dir(self) -> str:
        """A new private directory in this host's temp dir to write a checkpoint's files into
        before :meth:`place`. Never inside the store: DCP writes fixed names (``__0_0.distcp``)
        following symlinks, and an executor of another host could plant one there. A rank killed
        mid-save leaves its directory (shards of a whole model): the next one made on this host
        removes it, once its process is gone."""
        return private_directory(CHECKPOINT_STAGING_PREFIX)

    def begin_step(self, manifest: Manifest) -> None:
        """Make the step's prefix ready for :meth:`place` (a step written again is uncommitted)."""
        name = step_dir(manifest.step, manifest.run)
        if self.fs is None:
            self._make_step_dir(name)
        self._remove(self._join(name, MANIFEST))

    def place(self, manifest: Manifest, file_name: str, local: str) -> None:
        """Put the finished local file ``local`` in the step's prefix as ``file_name`` (renamed
        locally, copied when the temp dir is another filesystem; uploaded remotely); the manifest
        that lists it is written after."""
        path = self._join(step_dir(manifest.step, manifest.run), checked_file_name(file_name))
        try:
            self._put(local, path)
        except OSError as exc:
            if self.fs is not None or exc.errno != errno.EXDEV:
                raise
            copy_replacing(local, path)

    def rewrite_manifest(self, manifest: Manifest) -> None:
        """Replace a committed checkpoint's manifest (to record that its run finished)."""
        self._write(self._join(step_dir(manifest.step, manifest.run), MANIFEST), manifest.to_json().encode())

    def delete(self, manifest: Manifest) -> None:
        """Uncommit (the manifest goes first), then remove the step's files."""
        name = step_dir(manifest.step, manifest.run)
        names = [MANIFEST, *sorted({STATE, *manifest.files})]  # names checked when the manifest was read
        if self.fs is None:
            self._delete_local(name, names)
            delete_positions(self, manifest)  # the step's data positions (resume_position)
            return
        for file_name in names:
            self._remove(self._join(name, file_name))
        delete_positions(self, manifest)

    def _delete_local(self, name: str, file_names: list[str]) -> None:
        """Unlink ``file_names`` inside the step's directory through a descriptor of it, opened
        ``O_NOFOLLOW``: a step swapped for a symlink since its manifest was read (anyone can write
        the store) is left alone, not followed into the directory it names."""
        try:
            fd = os.open(self._join(name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return  # gone, or no directory of its own (ELOOP, ENOTDIR): nothing of ours to delete
        try:
            for file_name in file_names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(file_name, dir_fd=fd)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):  # something else in it: left as it is
            os.rmdir(self._join(name))

    # -- reading ---------------------------------------------------------------------------

    @contextmanager
    def open_file(self, manifest: Manifest, file_name: str = STATE) -> Iterator[BinaryIO]:
        """One of the checkpoint's files as an open file, checked against its manifest first (a
        torn or swapped file fails); a remote one is copied to a private temporary file as it
        streams in."""
        if file_name not in manifest.files:
            raise CheckpointStoreError(f"{self.uri_of(manifest)} has no file {file_name!r}")
        path = self._join(step_dir(manifest.step, manifest.run), checked_file_name(file_name))
        with self._open(path) as source:
            expected = manifest.files[file_name]
            if digest(source) != {"bytes": expected.get("bytes"), "sha256": expected.get("sha256")}:
                raise CheckpointStoreError(
                    f"{path} does not match its manifest (size or SHA-256): it was changed after the commit"
                )
            source.seek(0)
            yield source

    def open_state(self, manifest: Manifest) -> Any:
        """The checkpoint's ``state.pt`` (what ``save_checkpoint`` wrote), as :meth:`open_file`."""
        return self.open_file(manifest, STATE)

    def read_state(self, manifest: Manifest) -> bytes:
        """The checkpoint's state, checked against its manifest (see :meth:`open_file`)."""
        with self.open_state(manifest) as source:
            return source.read()

    def fetch(self, manifest: Manifest, directory: str, names: Iterable[str] | None = None) -> list[str]:
        """Copy every file of the checkpoint (or those of ``names``) into the local ``directory``
        (created 0700 if missing), each checked against the manifest, then renamed into place (so
        processes fetching the same checkpoint into one directory at once never see a torn file);
        returns the names."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            raise NotADirectoryError(f"{directory} is not a directory (a symlink?): nothing fetched")
        wanted = sorted(manifest.files if names is None else set(names))
        for file_name in wanted:
            if file_name not in manifest.files:
                raise CheckpointStoreError(f"{self.uri_of(manifest)} has no file {file_name!r}")
            path = self._join(step_dir(manifest.step, manifest.run), checked_file_name(file_name))
            fd, tmp = tempfile.mkstemp(prefix=f".{file_name}.", suffix=".tmp", dir=directory)
            try:
                # One pass: hashed as it is copied, then checked (the copy is private: what was
                # checked is what is read later).
                with os.fdopen(fd, "wb") as out, self._stream(path) as source:
                    hashing = HashingWriter(out)
                    shutil.copyfileobj(source, hashing, CHUNK)
                expected = manifest.files[file_name]
                if hashing.digest() != {"bytes": expected.get("bytes"), "sha256": expected.get("sha256")}:
                    raise CheckpointStoreError(
                        f"{path} does not match its manifest (size or SHA-256): it was changed after the commit"
                    )
                os.replace(tmp, os.path.join(directory, file_name))
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        return wanted
