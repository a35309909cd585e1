"""Rank 0's return value on its way to the driver: encoded, hashed while written, handed over once."""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import threading
from typing import Any

from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.node.storage_pickling import dump_output
from airflow_provider_torchdist.spark.wire.output_store import (
    FORMAT_JSON,
    FORMAT_PICKLE,
    encode_json,
    is_json_native,
    type_name,
)


class DigestingWriter:
    """A binary file that also computes the sha256 of everything written to it, in a thread.

    ``hashlib`` releases the GIL on large updates, so the digest of a large pickle is computed on
    another core while the pickler goes on, instead of in a second pass over the file afterwards.
    Chunks are hashed in the order they were written; the queue is bounded, so a slow hash holds the
    writer back rather than piling up memory.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._sha256 = hashlib.sha256()
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._hash, daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._sha256.update(chunk)

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        # The pickler hands over immutable bytes, or tensor memory that stays as it is until the
        # dump ends (and hexdigest() waits for the hash): both are safe to hash a moment later.
        self._chunks.put(data)
        return written

    def hexdigest(self) -> str:
        """Wait for the hash to catch up; the digest of everything written."""
        self._chunks.put(None)
        self._thread.join()
        return self._sha256.hexdigest()


def send_output(client: ChannelClient | None, value: Any, output_dir: str | None = None) -> None:
    """Encode rank 0's return value and hand it to the driver, which accepts it once, atomically.

    Rank 0 decides the encoding, so the Airflow side never unpickles to find out: a JSON-native
    value is written as JSON, anything else pickled, tensor memory written as it is
    (:mod:`~airflow_provider_torchdist.spark.node.storage_pickling`), so pickling costs no second copy.
    The file's sha256 is computed while it is written and sent along: the Airflow side signs it
    without reading the file again. With ``output_dir`` (the driver's, on this machine) the file is
    written there and the driver is told its name: no copy over the channel.
    """
    fmt = FORMAT_JSON if is_json_native(value) else FORMAT_PICKLE
    fd, path = tempfile.mkstemp(prefix=".torchdist-output-", suffix=".pkl", dir=output_dir)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                writer = DigestingWriter(f)
                try:
                    if fmt == FORMAT_JSON:
                        writer.write(encode_json(value))
                    else:
                        dump_output(value, writer)
                finally:
                    digest = writer.hexdigest()
        except OSError as exc:  # the file, not the value: a full disk, say
            raise OSError(
                exc.errno,
                f"rank 0's return value could not be written to {os.path.dirname(path)}: {exc.strerror}",
            ) from exc
        except Exception as exc:
            raise TypeError(
                f"rank 0's return value ({type(value).__qualname__}) could not be pickled: {exc}. "
                "Return plain data (numbers, lists, dicts, tensors, state_dicts) instead."
            ) from exc
        meta = {"format": fmt, "type": type_name(value), "sha256": digest}
        if client is None:
            raise ConnectionError("rank 0 could not send its return value to the driver: no connection")
        sent = (
            client.output_in_place(os.path.basename(path), **meta)
            if output_dir is not None
            else client.output_file(path, **meta)
        )
        if not sent:
            raise ConnectionError(f"rank 0 could not send its return value to the driver: {client.broken}")
        if output_dir is not None:
            path = ""  # the driver owns the file now
    finally:
        if path and os.path.exists(path):
            os.unlink(path)
