"""The lifeline's stream after the handshake, sealed: every message in both directions carries a MAC
under a key of its direction and session, over its number in the stream and its bytes.

The handshake proves who is at each end; this keeps a network in between from changing what they
say afterwards. Each session derives two keys from the run's owner secret and both handshake nonces
(:func:`session_keys`), one per direction, so a message can be neither reflected back to its sender
nor replayed into another session (its nonces differ). Each direction numbers its messages from 0
and the number is not sent: a message injected, changed, reordered, replayed or dropped makes the
next one fail its MAC, and the reader ends the connection (:class:`StreamTampered`).

On the wire a sealed message is ``<64 hex digits of HMAC-SHA256> <JSON line>``::

    mac = HMAC(key, <8-byte big-endian number> + <JSON line, its newline included>)

The raw bytes of a fetched output are not sealed one by one: the sealed ``output`` header states
their size and SHA-256, which must also be those of the sealed ``done`` status; the owner hashes the
bytes and compares (:mod:`.output`). An end of the stream is never a message: an owner takes a run
for ended only from a sealed ``done``, and treats any other end as a broken connection.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, BinaryIO

from airflow_provider_torchdist.supervision.lifeline.messages import (
    MAX_LINE_BYTES,
    LifelineError,
    MalformedMessage,
    decode,
    encode,
)

_MAC_HEX = 64
#: What sealing adds to a message: the MAC's hex digits and a space.
SEAL_BYTES = _MAC_HEX + 1
#: The longest sealed line, its newline included.
MAX_SEALED_LINE_BYTES = MAX_LINE_BYTES + SEAL_BYTES
OWNER_TO_SUPERVISOR = "owner->supervisor"
SUPERVISOR_TO_OWNER = "supervisor->owner"


class StreamTampered(LifelineError):
    """A message after the handshake failed its MAC: injected, changed, reordered, replayed or
    dropped on the way. The connection is not used any further."""


def session_keys(secret: bytes, run_id: str, client_nonce: str, server_nonce: str) -> dict[str, bytes]:
    """The two keys of one session, by direction (:data:`OWNER_TO_SUPERVISOR`,
    :data:`SUPERVISOR_TO_OWNER`): HMAC of the owner secret over a domain of their own (never a
    handshake proof's), the direction, the run and both nonces."""
    return {
        direction: hmac.new(
            secret,
            b"|".join(
                [
                    b"torchdist-lifeline-session",
                    direction.encode(),
                    run_id.encode(),
                    client_nonce.encode(),
                    server_nonce.encode(),
                ]
            ),
            hashlib.sha256,
        ).digest()
        for direction in (OWNER_TO_SUPERVISOR, SUPERVISOR_TO_OWNER)
    }


def _mac(key: bytes, number: int, line: bytes) -> bytes:
    return hmac.new(key, number.to_bytes(8, "big") + line, hashlib.sha256).hexdigest().encode()


class Sealer:
    """One direction's sending end: seals each message with the next number. Not thread-safe: a
    sender holds its write lock (or is the only thread that writes) around :meth:`seal` and the send."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._number = 0

    def seal(self, line: bytes) -> bytes:
        """``line``, one encoded message (:func:`~.messages.encode`), as it goes on the wire."""
        sealed = _mac(self._key, self._number, line) + b" " + line
        self._number += 1
        return sealed

    def seal_message(self, msg: dict[str, Any]) -> bytes:
        return self.seal(encode(msg))


class Opener:
    """One direction's receiving end: checks each message's MAC against the next number.

    ``who`` names the stream in errors ("the supervisor of run r at h:p"). After one message fails,
    every later read fails too: the stream is not trusted again."""

    def __init__(self, key: bytes, who: str) -> None:
        self._key = key
        self._number = 0
        self._who = who
        self._failed: StreamTampered | None = None

    def open(self, raw: bytes) -> dict[str, Any]:
        """The message in one sealed line (its newline included)."""
        if self._failed is not None:
            raise self._failed
        mac, line = raw[:_MAC_HEX], raw[SEAL_BYTES:]
        if (
            len(raw) <= SEAL_BYTES
            or raw[_MAC_HEX:SEAL_BYTES] != b" "
            or not hmac.compare_digest(mac, _mac(self._key, self._number, line))
        ):
            self._failed = StreamTampered(
                f"the lifeline stream from {self._who} was tampered with: its message #{self._number} "
                "does not carry the session's MAC (injected, changed, reordered, replayed or dropped on "
                "the way). The connection is closed and nothing more from it is used; a new connection "
                "authenticates afresh."
            )
            raise self._failed
        self._number += 1
        return decode(line)

    def read(self, reader: BinaryIO) -> dict[str, Any] | None:
        """The next message from a buffered socket reader; None when the other end closed (in the
        middle of a line too: nothing unsealed is ever taken for a message)."""
        raw = reader.readline(MAX_SEALED_LINE_BYTES + 1)
        if not raw.endswith(b"\n"):
            if len(raw) > MAX_SEALED_LINE_BYTES:
                raise MalformedMessage(f"a message of more than {MAX_LINE_BYTES} bytes was refused")
            return None
        return self.open(raw)


def supervisor_stream(
    secret: bytes, run_id: str, client_nonce: str, server_nonce: str, peer: str
) -> tuple[Sealer, Opener]:
    """The supervisor's sealer of what it sends an owner at ``peer``, and opener of its commands."""
    keys = session_keys(secret, run_id, client_nonce, server_nonce)
    opener = Opener(keys[OWNER_TO_SUPERVISOR], f"the owner of run {run_id} at {peer}")
    return Sealer(keys[SUPERVISOR_TO_OWNER]), opener
