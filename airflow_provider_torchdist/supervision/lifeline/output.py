"""Rank 0's output over the lifeline, once the run has ended: the owner asks with ``fetch``; the
supervisor answers ``{"k": "output", "manifest": {...}}`` and exactly ``size`` raw bytes
(:func:`send_output`); the owner checks them against the run's status and keeps them
(:func:`receive_output`).

The header is sealed as every message is (:mod:`.sealed`); the raw bytes are not, but their size and
SHA-256 are what the sealed header and the sealed ``done`` status state, and the owner hashes what
it got before it keeps any of it."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.wire.output_store import publish_output
from airflow_provider_torchdist.supervision.lifeline.events import (
    ErrorEvent,
    _Closing,
    _Events,
    _OutputHeader,
    parse_server_message,
)
from airflow_provider_torchdist.supervision.lifeline.messages import LifelineError
from airflow_provider_torchdist.supervision.lifeline.sealed import Opener, Sealer

_CHUNK = 1 << 20


def receive_output(
    reader: BinaryIO,
    opener: Opener,
    events: _Events,
    silence: float,
    expected: dict[str, Any],
    dest_dir: Path,
) -> Path:
    """Rank 0's output after a ``fetch``: the sealed header, checked against the ``expected``
    manifest of the sealed status, then the bytes, checked against its size and SHA-256, kept in
    ``dest_dir``."""
    header = _output_header(reader, opener, events, silence)
    if header.manifest is None:
        raise LifelineError(
            f"the supervisor of run {events.run_id} has no output to send, though the run reported one: "
            f"{header.error or 'no reason given'}"
        )
    if header.manifest != expected:
        raise LifelineError(
            f"the supervisor of run {events.run_id} sent an output manifest {header.manifest} that is not the "
            f"run's {expected}"
        )
    part = dest_dir / ".torchdist-output-fetch.part"
    digest = hashlib.sha256()
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            left = expected["size"]
            while left:
                try:
                    chunk = reader.read(min(_CHUNK, left))
                except TimeoutError:
                    raise events.silent(silence) from None
                except OSError as exc:
                    raise LifelineError(f"the output of run {events.run_id} broke off: {exc}") from None
                if not chunk:
                    raise LifelineError(
                        f"the output of run {events.run_id} broke off after {expected['size'] - left} of "
                        f"{expected['size']} bytes"
                    )
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != expected["sha256"]:
            raise LifelineError(
                f"the output of run {events.run_id} does not match its SHA-256 {expected['sha256']}: it is not used"
            )
        return publish_output(
            part,
            dest_dir,
            format=expected["format"],
            type=expected["type"],
            sha256=expected["sha256"],
            generation="lifeline",
        )
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _output_header(reader: BinaryIO, opener: Opener, events: _Events, silence: float) -> _OutputHeader:
    while True:
        try:
            msg = opener.read(reader)
        except TimeoutError:
            raise events.silent(silence) from None
        except OSError as exc:
            raise LifelineError(
                f"the lifeline to run {events.run_id} broke while fetching its output: {exc}"
            ) from None
        if msg is None:
            raise events.closed("", "sending the output")
        parsed = parse_server_message(msg)
        if isinstance(parsed, _OutputHeader):
            return parsed
        if isinstance(parsed, ErrorEvent):
            raise LifelineError(
                f"the supervisor of run {events.run_id} did not send the output: {parsed.message}"
            )
        if isinstance(parsed, _Closing):
            events.closing = parsed.reason


def send_output(
    sock: socket.socket, sealer: Sealer, manifest: dict[str, Any] | None, path: Path | None
) -> None:
    """The supervisor's answer to ``fetch``: the sealed manifest, then exactly ``size`` raw bytes of
    ``path``; a header with no manifest (and why) when there is none to send."""
    if manifest is None or path is None:
        sock.sendall(sealer.seal_message({"k": "output", "manifest": None}))
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        error = f"cannot open {path}: {exc.strerror}"
        sock.sendall(sealer.seal_message({"k": "output", "manifest": None, "error": error}))
        return
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != manifest["size"]:
            error = f"{path} holds {size} bytes, not the {manifest['size']} its manifest says"
            sock.sendall(sealer.seal_message({"k": "output", "manifest": None, "error": error}))
            return
        sock.sendall(sealer.seal_message({"k": "output", "manifest": manifest}))
        if size:
            sock.sendfile(f, 0, size)
