"""The shard files of ``train_data``: packed by the executors that compute the rows, written per rank
by the node that trains on them.

:class:`BlobPacker` turns a partition's rows into Arrow IPC streams per rank ("blobs") in the task
that computes them, so that Spark's shuffle moves a few large binary values instead of converting
every row to Arrow on the other side. :class:`ShardWriter` writes each rank's rows into
``rank-<RANK>.arrow`` (Arrow's IPC file format, which :mod:`.rank_data` maps).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.data.rank_data import shard_file
from airflow_provider_torchdist.spark.data.shard_plan import TrainDataError
from airflow_provider_torchdist.spark.wire.private_files import DATA_DIR_PREFIX, private_directory


class BlobPacker:
    """Collects each rank's rows and hands them out as Arrow IPC streams of about ``blob_bytes``."""

    def __init__(self, blob_bytes: int) -> None:
        self._blob_bytes = blob_bytes
        self._pending: dict[int, list[Any]] = {}
        self._sizes: dict[int, int] = {}

    def add(self, rank: int, batch: Any) -> Iterator[tuple[int, bytes]]:
        """Take ``rank``'s rows; yields ``(rank, blob)`` when enough are held."""
        self._pending.setdefault(rank, []).append(batch)
        self._sizes[rank] = self._sizes.get(rank, 0) + batch.nbytes
        if self._sizes[rank] >= self._blob_bytes:
            yield rank, self._blob(rank)

    def flush(self) -> Iterator[tuple[int, bytes]]:
        for rank in list(self._pending):
            if self._pending[rank]:
                yield rank, self._blob(rank)

    def _blob(self, rank: int) -> bytes:
        import pyarrow as pa

        batches, self._pending[rank], self._sizes[rank] = self._pending[rank], [], 0
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batches[0].schema) as stream:
            for batch in batches:
                stream.write_batch(batch)
        return sink.getvalue().to_pybytes()


class ShardWriter:
    """Writes a stream of tagged batches into one Arrow file per rank, without the helper columns.

    Spark hands over batches of 10,000 rows; a rank's ``rank_batches`` is zero-copy only within one
    record batch, so the writer joins them into record batches of about ``FLUSH_BYTES`` first.
    """

    FLUSH_BYTES = 64 << 20

    def __init__(
        self,
        directory: str | Path,
        ranks: Iterable[int],
        schema: Any,
        expected: dict[int, int] | None = None,
        files: dict[int, str] | None = None,
    ) -> None:
        import pyarrow as pa

        self.directory = Path(directory)
        self._schema = schema
        #: The plan's rows per rank: a different count at the end means the query is not deterministic.
        self._expected = expected
        #: Where each key's rows go: ``rank-<RANK>.arrow`` in ``directory``, unless ``files`` says.
        self.paths = files or {r: str(shard_file(directory, r)) for r in ranks}
        self._files = {r: pa.OSFile(path, "wb") for r, path in self.paths.items()}
        self._writers = {r: pa.ipc.new_file(f, schema) for r, f in self._files.items()}
        self._pending: dict[int, list[Any]] = {r: [] for r in self._writers}
        self._pending_bytes = dict.fromkeys(self._writers, 0)
        #: Rows written per rank.
        self.rows = dict.fromkeys(self._writers, 0)

    def _add(self, rank: int, part: Any) -> None:
        self._pending[rank].append(part)
        self._pending_bytes[rank] += part.nbytes
        self.rows[rank] += part.num_rows
        if self._pending_bytes[rank] >= self.FLUSH_BYTES:
            self._flush(rank)

    def _flush(self, rank: int) -> None:
        import pyarrow as pa

        if self._pending[rank]:
            joined = pa.Table.from_batches(self._pending[rank], schema=self._schema).combine_chunks()
            for batch in joined.to_batches():
                self._writers[rank].write_batch(batch)
        self._pending[rank], self._pending_bytes[rank] = [], 0

    def add(self, rank: int, batch: Any) -> None:
        """Some of ``rank``'s rows: a record batch with the file's columns."""
        import pyarrow as pa

        if rank not in self._writers:
            raise TrainDataError(
                f"a row for rank {rank} reached a node that holds ranks {sorted(self._writers)}"
            )
        # The same columns; Spark's optimizer may know one is never null (a filter on it) where
        # the query's schema, this file's, says it may be: relabel, no copy.
        self._add(rank, pa.RecordBatch.from_arrays(batch.columns, schema=self._schema))

    def add_ipc(self, rank: int, blob: bytes) -> None:
        """One blob of :class:`BlobPacker`'s: an Arrow IPC stream of ``rank``'s rows."""
        import pyarrow as pa

        for batch in pa.ipc.open_stream(blob):
            self.add(rank, batch)

    def close(self) -> None:
        for rank in self._writers:
            self._flush(rank)
        for writer in self._writers.values():
            writer.close()
        for f in self._files.values():
            f.close()

    def abandon(self) -> None:
        """Close and remove every file (after a failure: a full disk keeps nothing half-written)."""
        for f in self._files.values():
            f.close()
        for path in self.paths.values():
            Path(path).unlink(missing_ok=True)

    def check_complete(self) -> None:
        """Raise when a rank got other than the plan's count of rows (a query that changed)."""
        wrong = {r: n for r, n in self.rows.items() if self._expected is not None and n != self._expected[r]}
        if wrong:
            raise TrainDataError(
                f"train_data is not deterministic: rank(s) {sorted(wrong)} got {sorted(wrong.values())} rows, "
                f"not the {self._expected[min(wrong)]} counted before. Make the query return the same rows "
                "each time it runs (no rand() without a seed, no source that changes while the run starts)."
            )


def new_node_directory() -> str:
    """A private directory for this node's shards. Its name carries this process's PID: a task
    killed before it removed its directory leaves one whose process is dead, which the next node
    on this host (and the Airflow worker's sweep, ``sweep.py``) removes (:func:`private_directory`)."""
    return private_directory(DATA_DIR_PREFIX)


def remove_directory(directory: str | Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def write_blobs(rows: Iterator[Any], writer: ShardWriter) -> None:
    """Write the blobs of ``rows`` into their ranks' files: record batches with a ``rank`` and an
    ``ipc`` column (``data_shards.BLOB_SCHEMA``)."""
    for batch in rows:
        for rank, blob in zip(batch.column("rank").to_pylist(), batch.column("ipc").to_pylist(), strict=True):
            writer.add_ipc(rank, blob)
