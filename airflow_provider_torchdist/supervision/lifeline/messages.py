"""The lifeline's limits and constants, its errors, and its messages: one encoder, one decoder.

Every message is one JSON object on one line, at most ``MAX_LINE_BYTES`` with its newline;
:func:`decode` turns anything else into :class:`MalformedMessage`. The small checks here
(``_exact_keys``, ``_require``, ...) are what the stricter parsers of the other modules build on.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.wire.json_lines import json_object

#: 2: the supervisor's proof covers the status it answers with, and the owner's credential is
#: bound to the run's task instance (a supervisor of 1 refuses a 2 client, saying so).
#: 3: every message after the handshake, both ways, carries a MAC of its session (:mod:`.sealed`).
LIFELINE_VERSION = 3
#: How often an owner (and an idle supervisor) says it is still there.
PING_INTERVAL_S = 5.0
#: Silence after which the other end counts as gone.
OWNER_SILENCE_S = 15.0
#: How many of the latest log lines the supervisor keeps for an owner that attaches later.
REPLAY_LINES = 1000
#: The deadline of the whole handshake.
HELLO_TIMEOUT_S = 10.0
#: The longest message, its newline included.
MAX_LINE_BYTES = 1 << 20
#: How long the supervisor waits for each line an owner owes in the handshake (its hello, then its
#: proof): an owner sends each at once, so a connection that says nothing frees its slot soon.
HANDSHAKE_LINE_TIMEOUT_S = 2.0
#: Connections that may be in their handshake at once; more are turned away (``busy``).
MAX_PENDING_HELLOS = 16
#: Of those, how many may come from one TCP source address (see :mod:`.slots`).
MAX_PENDING_PER_SOURCE = 4
#: The shortest owner secret either end accepts.
MIN_SECRET_BYTES = 32

OWNER_KINDS = ("task", "trigger")
KINDS = (*OWNER_KINDS, "status")
STATES = ("starting", "running", "succeeded", "failed")
ENDED_STATES = ("succeeded", "failed")
#: What a failed run's ``error_kind`` can be (None for a run that has not failed).
ERROR_KINDS = (None, "training", "run")
COMMANDS = ("ping", "stop", "detach", "release", "fetch")
#: The longest ``why`` a ``stop`` command carries ("timeout", "killed", ...).
MAX_WHY_CHARS = 200

#: How much of one log line travels (in characters): JSON may spell a character in 6 bytes.
MAX_TEXT_CHARS = MAX_LINE_BYTES // 8
#: A status carries the newest metrics that fit in this many bytes of JSON (``metrics_dropped``
#: would not fit the fixed status fields: older ones are left out, the run's log says so).
METRICS_BUDGET_BYTES = 384 * 1024
#: A status carries the newest world-size changes that fit in this many bytes of JSON (an elastic
#: run changes size once per loss or join, bounded by ``max_restarts``: this is room to spare).
WORLD_SIZES_BUDGET_BYTES = 32 * 1024
#: The longest ``reason`` of a world-size change a status carries (longer ones are cut).
WORLD_SIZE_REASON_CHARS = 500
#: Per failure, the tail of its traceback and the head of its message that a status carries.
FAILURE_TRACEBACK_CHARS = 16 * 1024
FAILURE_MESSAGE_CHARS = 4 * 1024
#: How many events may wait for one owner that reads slowly; beyond it events are dropped for it.
OWNER_QUEUE_LIMIT = 100_000


# -- errors ---------------------------------------------------------------------------------------


class LifelineError(Exception):
    """The lifeline to a run's supervisor failed, or the other end broke the protocol."""


class RunGone(LifelineError):
    """No supervisor of this run is there: it ended and was torn down, or never started."""


class LifelineUnreachable(LifelineError, ConnectionError):
    """The supervisor's address did not answer in time (network, or a machine down): maybe later.

    Also a ``ConnectionError``, so code that retries on network errors retries on it."""


class MalformedMessage(LifelineError):
    """A message that is not what the protocol allows (shape, type, size)."""


# -- messages: one encoder, one decoder ------------------------------------------------------------


def encode(msg: dict[str, Any]) -> bytes:
    """One message as its JSON line; :class:`MalformedMessage` when it is over ``MAX_LINE_BYTES``."""
    line = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise MalformedMessage(
            f"a {msg.get('k', 'handshake')!r} message of {len(line)} bytes is over the "
            f"lifeline's {MAX_LINE_BYTES}-byte limit"
        )
    return line


def decode(raw: bytes) -> dict[str, Any]:
    """The JSON object in one line (its newline included); :class:`MalformedMessage` otherwise."""
    if len(raw) > MAX_LINE_BYTES:
        raise MalformedMessage(f"a message of more than {MAX_LINE_BYTES} bytes was refused")
    return json_object(raw, MalformedMessage)


def read_message(reader: BinaryIO) -> dict[str, Any] | None:
    """The next message from a buffered socket reader; None when the other end closed."""
    raw = reader.readline(MAX_LINE_BYTES + 1)
    if not raw.endswith(b"\n"):
        if len(raw) > MAX_LINE_BYTES:
            raise MalformedMessage(f"a message of more than {MAX_LINE_BYTES} bytes was refused")
        return None  # closed, possibly in the middle of a line
    return decode(raw)


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is not an int here


def _opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise MalformedMessage(what)


def _exact_keys(msg: dict[str, Any], keys: set[str], what: str, optional: set[str] = frozenset()) -> None:
    missing, extra = keys - set(msg), set(msg) - keys - optional
    if missing or extra:
        raise MalformedMessage(f"{what}: missing {sorted(missing)}, unexpected {sorted(extra)}")
