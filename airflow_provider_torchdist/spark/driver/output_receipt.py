"""The driver taking rank 0's value off the run channel, into the output store.

Socket-free: it reads the value's bytes from the connection's file object, so tests can hand it
any binary stream. The rules (one output per generation, the newest kept) are the
:class:`~airflow_provider_torchdist.spark.wire.output_store.OutputLedger`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE
from airflow_provider_torchdist.spark.wire.output_store import Generation, OutputLedger
from airflow_provider_torchdist.spark.wire.protocol import Output, OutputFile, output_meta

_CHUNK = 1 << 20


def receive_output(
    outputs: OutputLedger, output_dir: Path, msg: Output | OutputFile, generation: Generation, rfile: BinaryIO
) -> None:
    """Publish rank 0's value: streamed (``Output``, its bytes read from ``rfile``) or written in place
    in ``output_dir`` (``OutputFile``). Raises ``ValueError`` for a second output in ``generation``
    or bytes that end early; a partial file never replaces the output."""
    outputs.claim(generation)  # one output per generation: a second one is refused here
    if isinstance(msg, OutputFile):
        outputs.publish_in_place(msg.name, generation, **output_meta(msg))
        return
    part = output_dir / f".{OUTPUT_FILE}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        left = msg.size
        while left:
            chunk = rfile.read(min(left, _CHUNK))
            if not chunk:
                raise ValueError(f"rank 0's output ended after {msg.size - left} of {msg.size} bytes")
            f.write(chunk)
            left -= len(chunk)
    outputs.publish(part, generation, **output_meta(msg))
