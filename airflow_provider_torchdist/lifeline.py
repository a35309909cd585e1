"""The lifeline: how a run's owner (its task, a trigger, a retry) talks to the run's supervisor.

A supervised run (:mod:`~airflow_provider_torchdist.supervisor`) outlives the task that started it.
Its owner follows it over one TCP connection of JSON lines (at most ``MAX_LINE_BYTES`` each,
newline included; anything longer is refused). Both ends prove they hold the run's owner secret
(:func:`~airflow_provider_torchdist.run_record.owner_secret`): the owner, because it may stop the
run; the supervisor, because the owner signs whatever output it fetches from it.

The handshake (``HELLO_TIMEOUT_S`` for all of it)::

    owner      -> {"v": 1, "run_id": ..., "kind": "task"|"trigger"|"status", "since": n, "nonce": cn}
    supervisor -> {"nonce": sn}                        or {"error": ..., "code": ...} and it closes
    owner      -> {"proof": HMAC(secret, "owner|<run_id>|<kind>|<sn>|<cn>")}
    supervisor -> {"ok": true, "proof": HMAC(secret, "supervisor|<run_id>|<cn>|<sn>"), "status": {...}}
                                                       or {"error": ...} and it closes

A ``status`` connection ends there (:func:`query_status`). An owner then gets the kept log lines
after line ``since`` (the last ``REPLAY_LINES``), then the live stream: ``line``, ``app``,
``metric`` and, once, ``done`` with the final status; the supervisor sends ``ping`` when it has
nothing else to say. The owner sends ``ping`` every ``PING_INTERVAL_S`` (``OWNER_SILENCE_S`` without
a message is a lost owner), and the commands ``stop``, ``detach``, ``release`` and ``fetch`` (after
``done``: ``{"k": "output", "manifest": {...}}`` and exactly ``size`` raw bytes).

Example::

    with OwnerConnection(host, port, run_id, owner_secret(run_id)) as owner:
        for event in owner.events():
            if isinstance(event, LineEvent):
                print(event.text)
        path = owner.fetch_output(Path(tmp))  # rank 0's output file with its manifest, or None
        owner.release()                       # the supervisor tears the run down

The supervisor's side is :class:`LifelineServer`, which serves a :class:`RunState` (the plain
object the supervisor updates) and tells an :class:`OwnerListener` what owners do. Standard library
(and this package's standard-library modules) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from airflow_provider_torchdist.spark.channel_auth import HelloRefused, read_line
from airflow_provider_torchdist.spark.outcome import RankFailure
from airflow_provider_torchdist.spark.output_store import FORMATS, publish_output

LIFELINE_VERSION = 1
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
#: Connections that may be in their handshake at once; more are turned away.
MAX_PENDING_HELLOS = 16
#: The shortest owner secret either end accepts.
MIN_SECRET_BYTES = 32

OWNER_KINDS = ("task", "trigger")
KINDS = (*OWNER_KINDS, "status")
STATES = ("starting", "running", "succeeded", "failed")
ENDED_STATES = ("succeeded", "failed")
#: What a failed run's ``error_kind`` can be (None for a run that has not failed).
ERROR_KINDS = (None, "training", "run")
COMMANDS = ("ping", "stop", "detach", "release", "fetch")

#: How much of one log line travels (in characters): JSON may spell a character in 6 bytes.
MAX_TEXT_CHARS = MAX_LINE_BYTES // 8
#: A status carries the newest metrics that fit in this many bytes of JSON (``metrics_dropped``
#: would not fit the fixed status fields: older ones are left out, the run's log says so).
METRICS_BUDGET_BYTES = 384 * 1024
#: Per failure, the tail of its traceback and the head of its message that a status carries.
FAILURE_TRACEBACK_CHARS = 16 * 1024
FAILURE_MESSAGE_CHARS = 4 * 1024
#: How many events may wait for one owner that reads slowly; beyond it events are dropped for it.
OWNER_QUEUE_LIMIT = 100_000

_NONCE = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_HELLO_BYTES = 4096
_CHUNK = 1 << 20


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
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise MalformedMessage(f"not a JSON message: {exc}") from None
    if not isinstance(msg, dict):
        raise MalformedMessage(f"a message must be a JSON object, got {type(msg).__name__}")
    return msg


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


def owner_proof(secret: bytes, run_id: str, kind: str, server_nonce: str, client_nonce: str) -> str:
    """What the owner answers the supervisor's challenge with."""
    data = b"|".join([b"owner", run_id.encode(), kind.encode(), server_nonce.encode(), client_nonce.encode()])
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def supervisor_proof(secret: bytes, run_id: str, client_nonce: str, server_nonce: str) -> str:
    """What the supervisor proves itself with; another domain than :func:`owner_proof`, so one
    can never be replayed as the other."""
    data = b"|".join([b"supervisor", run_id.encode(), client_nonce.encode(), server_nonce.encode()])
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _check_secret(secret: Any) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a lifeline secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def _check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200 or not run_id.isprintable():
        raise ValueError(
            f"a run id must be a non-empty printable string of at most 200 characters: {run_id!r}"
        )
    return run_id


# -- the status ----------------------------------------------------------------------------------

_FAILURE_FIELDS = {f.name: f.type for f in dataclasses.fields(RankFailure)}


def _valid_failure(value: Any) -> bool:
    if not isinstance(value, dict) or not set(value) <= set(_FAILURE_FIELDS):
        return False
    for name, item in value.items():
        wanted_int = "int" in str(_FAILURE_FIELDS[name])
        if item is not None and not (_is_int(item) if wanted_int else isinstance(item, str)):
            return False
    return True


def _valid_output(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"format", "type", "size", "sha256"}
        and value["format"] in FORMATS
        and isinstance(value["type"], str)
        and 0 < len(value["type"]) <= 200
        and _is_int(value["size"])
        and value["size"] >= 0
        and isinstance(value["sha256"], str)
        and bool(_HEX64.fullmatch(value["sha256"]))
    )


@dataclass(frozen=True)
class RunStatus:
    """Where a supervised run stands. ``failures`` are :class:`RankFailure` dicts; ``output`` is
    ``{"format", "type", "size", "sha256"}`` of rank 0's output (None: none, or not yet).
    ``error_kind`` says what failed, as the in-process path tells it apart: ``"training"`` (the
    driver reported the failed outcome: :class:`TrainingFailed`), ``"run"`` (spark-submit, the
    application or the supervisor ended it first: :class:`SparkSubmitFailed`); None unless failed."""

    state: str
    app_id: str | None = None
    ui_url: str | None = None
    error: str | None = None
    error_kind: str | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] | None = None
    last_seq: int = 0

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (a ``TriggerEvent`` payload, a message)."""
        return {
            "state": self.state,
            "app_id": self.app_id,
            "ui_url": self.ui_url,
            "error": self.error,
            "error_kind": self.error_kind,
            "failures": [dict(f) for f in self.failures],
            "metrics": [dict(m) for m in self.metrics],
            "output": None if self.output is None else dict(self.output),
            "last_seq": self.last_seq,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RunStatus:
        """A status as :meth:`to_dict` wrote it; :class:`MalformedMessage` for anything else."""
        _require(isinstance(data, dict), f"a status must be an object, got {type(data).__name__}")
        _exact_keys(data, {f.name for f in dataclasses.fields(cls)}, "malformed status")
        problems = [
            name
            for name, ok in (
                ("state", data["state"] in STATES),
                ("app_id", data["app_id"] is None or (isinstance(data["app_id"], str) and data["app_id"])),
                ("ui_url", _opt_str(data["ui_url"])),
                ("error", _opt_str(data["error"])),
                ("error_kind", data["error_kind"] in ERROR_KINDS),
                (
                    "failures",
                    isinstance(data["failures"], list) and all(map(_valid_failure, data["failures"])),
                ),
                (
                    "metrics",
                    isinstance(data["metrics"], list) and all(isinstance(m, dict) for m in data["metrics"]),
                ),
                ("output", data["output"] is None or _valid_output(data["output"])),
                ("last_seq", _is_int(data["last_seq"]) and data["last_seq"] >= 0),
            )
            if not ok
        ]
        _require(not problems, f"malformed status: bad {', '.join(problems)}")
        return cls(**data)


# -- events, as an owner gets them ------------------------------------------------------------------


@dataclass(frozen=True)
class LineEvent:
    """One line of the run's log; ``seq`` counts from 1 (give the last one as ``since`` to resume)."""

    seq: int
    text: str


@dataclass(frozen=True)
class AppEvent:
    """The Spark application is up."""

    app_id: str
    ui_url: str | None


@dataclass(frozen=True)
class MetricEvent:
    """One ``report()`` record."""

    record: dict[str, Any]


@dataclass(frozen=True)
class DoneEvent:
    """The run has ended (the last event of a stream)."""

    status: RunStatus


@dataclass(frozen=True)
class ErrorEvent:
    """The supervisor refused a command (``release`` of a run still training), or dropped events for
    an owner that fell behind; the lifeline stays up."""

    message: str


Event = LineEvent | AppEvent | MetricEvent | DoneEvent | ErrorEvent


@dataclass(frozen=True)
class _Ping:
    pass


@dataclass(frozen=True)
class _Closing:
    """The supervisor closes this lifeline now, and says why."""

    reason: str


@dataclass(frozen=True)
class _OutputHeader:
    manifest: dict[str, Any] | None
    error: str | None


def parse_server_message(msg: dict[str, Any]) -> Event | _Ping | _Closing | _OutputHeader:
    """What the supervisor sent an owner after the handshake; :class:`MalformedMessage` otherwise."""
    kind = msg.get("k")
    if kind == "line":
        _exact_keys(msg, {"k", "seq", "text"}, "malformed 'line' message")
        _require(_is_int(msg["seq"]) and msg["seq"] >= 1 and isinstance(msg["text"], str), "malformed 'line'")
        return LineEvent(msg["seq"], msg["text"])
    if kind == "app":
        _exact_keys(msg, {"k", "app_id", "ui_url"}, "malformed 'app' message")
        _require(
            isinstance(msg["app_id"], str) and bool(msg["app_id"]) and _opt_str(msg["ui_url"]),
            "malformed 'app'",
        )
        return AppEvent(msg["app_id"], msg["ui_url"])
    if kind == "metric":
        _exact_keys(msg, {"k", "m"}, "malformed 'metric' message")
        _require(isinstance(msg["m"], dict), "malformed 'metric'")
        return MetricEvent(msg["m"])
    if kind == "done":
        _exact_keys(msg, {"k", "status"}, "malformed 'done' message")
        status = RunStatus.from_dict(msg["status"])
        _require(status.ended, f"a 'done' message with the state {status.state!r}")
        return DoneEvent(status)
    if kind in ("error", "closing"):
        name = "message" if kind == "error" else "reason"
        _exact_keys(msg, {"k", name}, f"malformed {kind!r} message")
        _require(isinstance(msg[name], str), f"malformed {kind!r}")
        return ErrorEvent(msg[name]) if kind == "error" else _Closing(msg[name])
    if kind == "ping":
        _exact_keys(msg, {"k"}, "malformed 'ping' message")
        return _Ping()
    if kind == "output":
        _exact_keys(msg, {"k", "manifest"}, "malformed 'output' message", optional={"error"})
        manifest, error = msg["manifest"], msg.get("error")
        _require(manifest is None or _valid_output(manifest), "malformed 'output' manifest")
        _require(_opt_str(error), "malformed 'output' error")
        return _OutputHeader(manifest, error)
    raise MalformedMessage(f"unknown message kind {kind!r}")


def parse_command(msg: dict[str, Any]) -> str:
    """An owner's command (one of ``COMMANDS``); :class:`MalformedMessage` otherwise."""
    _exact_keys(msg, {"k"}, "malformed command")
    _require(msg["k"] in COMMANDS, f"unknown command {msg['k']!r} (one of {', '.join(COMMANDS)})")
    return msg["k"]


# -- the owner's side of the handshake, for both clients ------------------------------------------


class _ClientHandshake:
    """The owner's half of the mutual authentication, without I/O: both clients drive it."""

    def __init__(self, host: str, port: int, run_id: str, secret: bytes, kind: str, since: int) -> None:
        self.run_id = _check_run_id(run_id)
        self.secret = _check_secret(secret)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not _is_int(since) or since < 0:
            raise ValueError(f"since must be a line number >= 0, got {since!r}")
        self.kind, self.since = kind, since
        self.where = f"{host}:{port}"
        self.nonce = secrets.token_hex(16)
        self._server_nonce = ""

    def gone(self, why: str) -> RunGone:
        return RunGone(
            f"run {self.run_id} at {self.where} is gone: it ended and was torn down, or never started ({why})"
        )

    def unreachable(self, why: str) -> LifelineUnreachable:
        return LifelineUnreachable(
            f"the supervisor of run {self.run_id} at {self.where} did not answer: {why}"
        )

    def hello(self) -> bytes:
        return encode(
            {
                "v": LIFELINE_VERSION,
                "run_id": self.run_id,
                "kind": self.kind,
                "since": self.since,
                "nonce": self.nonce,
            }
        )

    def answer(self, msg: dict[str, Any] | None) -> bytes:
        """The supervisor's challenge in, the owner's proof out."""
        if msg is None:
            raise self.gone("the connection closed before any answer")
        if "error" in msg:
            text = msg["error"] if isinstance(msg["error"], str) else repr(msg["error"])
            if msg.get("code") == "wrong_run":  # another run's supervisor took the port: ours is not there
                raise self.gone(text)
            if msg.get("code") == "busy":
                raise self.unreachable(text)
            raise LifelineError(
                f"the supervisor at {self.where} refused the lifeline to run {self.run_id}: {text}"
            )
        _exact_keys(msg, {"nonce"}, f"the endpoint at {self.where} answered with no lifeline challenge")
        _require(
            isinstance(msg["nonce"], str) and bool(_NONCE.fullmatch(msg["nonce"])), "malformed challenge"
        )
        self._server_nonce = msg["nonce"]
        return encode(
            {"proof": owner_proof(self.secret, self.run_id, self.kind, self._server_nonce, self.nonce)}
        )

    def welcome(self, msg: dict[str, Any] | None) -> RunStatus:
        """The supervisor's proof and the run's status, checked."""
        if msg is None:
            raise LifelineError(f"the supervisor at {self.where} closed the lifeline during the handshake")
        if "error" in msg:
            raise LifelineError(
                f"the supervisor at {self.where} refused the lifeline to run {self.run_id}: {msg['error']}"
            )
        _exact_keys(msg, {"ok", "proof", "status"}, f"malformed handshake answer from {self.where}")
        expected = supervisor_proof(self.secret, self.run_id, self.nonce, self._server_nonce)
        if (
            msg["ok"] is not True
            or not isinstance(msg["proof"], str)
            or not hmac.compare_digest(msg["proof"], expected)
        ):
            raise LifelineError(
                f"the endpoint at {self.where} answered with the wrong credentials for run {self.run_id}: it is not "
                "that run's supervisor (another process took its port, or it holds another signing key). "
                "Nothing from it is used."
            )
        return RunStatus.from_dict(msg["status"])


class _Events:
    """What both clients make of the messages after the handshake."""

    def __init__(self, run_id: str, where: str) -> None:
        self.run_id, self.where = run_id, where
        self.done: RunStatus | None = None
        self.closing: str | None = None

    def take(self, msg: dict[str, Any] | None) -> Event | None:
        """The event in ``msg`` (None: nothing for the caller, e.g. a ping); raises at the end of a
        stream that has not seen ``done``."""
        if msg is None:
            if self.done is not None:
                return None
            why = f": {self.closing}" if self.closing else ""
            raise LifelineError(
                f"the supervisor of run {self.run_id} at {self.where} closed the lifeline before the run ended{why}"
            )
        parsed = parse_server_message(msg)
        if isinstance(parsed, _Ping):
            return None
        if isinstance(parsed, _Closing):
            self.closing = parsed.reason
            return None
        if isinstance(parsed, _OutputHeader):
            raise MalformedMessage("an 'output' message nobody asked for")
        if isinstance(parsed, DoneEvent):
            self.done = parsed.status
        return parsed

    def silent(self, seconds: float) -> LifelineError:
        return LifelineError(
            f"the supervisor of run {self.run_id} at {self.where} sent nothing for {seconds:g} s: the network "
            "or its machine is down"
        )


# -- the sync client ------------------------------------------------------------------------------


def _connect(
    handshake: _ClientHandshake, host: str, port: int, timeout: float
) -> tuple[socket.socket, BinaryIO, RunStatus]:
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except (ConnectionRefusedError, ConnectionResetError) as exc:
        raise handshake.gone(str(exc)) from None
    except OSError as exc:  # a timeout, an unreachable network, a name that does not resolve
        raise handshake.unreachable(str(exc) or type(exc).__name__) from None
    reader = sock.makefile("rb")
    try:

        def receive() -> dict[str, Any] | None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            return read_message(reader)

        try:
            sock.sendall(handshake.hello())
            challenge = receive()
        except ConnectionResetError as exc:
            raise handshake.gone(str(exc)) from None
        sock.sendall(handshake.answer(challenge))
        status = handshake.welcome(receive())
    except LifelineError:
        reader.close()
        sock.close()
        raise
    except TimeoutError:
        reader.close()
        sock.close()
        raise handshake.unreachable(f"no handshake within {timeout:g} s") from None
    except OSError as exc:
        reader.close()
        sock.close()
        raise LifelineError(
            f"the lifeline to run {handshake.run_id} at {handshake.where} broke: {exc}"
        ) from None
    except BaseException:
        reader.close()
        sock.close()
        raise
    return sock, reader, status


class OwnerConnection:
    """A lifeline to a run's supervisor, as its owner (see the module docstring).

    Connects and authenticates both ways in the constructor: :class:`RunGone` when nothing listens
    there, :class:`LifelineUnreachable` when the address does not answer, :class:`LifelineError`
    when the other end is not this run's supervisor or refuses the credential. ``status`` is the
    run's status at that moment. While open, a thread pings every ``PING_INTERVAL_S``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        run_id: str,
        secret: bytes,
        *,
        kind: str = "task",
        since: int = 0,
        timeout: float = HELLO_TIMEOUT_S,
        ping_interval: float = PING_INTERVAL_S,
        silence: float = OWNER_SILENCE_S,
    ) -> None:
        handshake = _ClientHandshake(host, port, run_id, secret, kind, since)
        self.run_id, self.kind, self.where = run_id, kind, handshake.where
        self._sock, self._reader, self.status = _connect(handshake, host, port, timeout)
        self._sock.settimeout(silence)
        self._silence = silence
        self._events = _Events(run_id, handshake.where)
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None
        if kind in OWNER_KINDS:
            self._pinger = threading.Thread(
                target=self._ping, args=(ping_interval,), name="torchdist-lifeline-ping", daemon=True
            )
            self._pinger.start()

    def events(self) -> Iterator[Event]:
        """The run's events, up to and including :class:`DoneEvent`.

        Raises :class:`LifelineError` when the lifeline closes or goes silent before ``done`` (the
        supervisor's reason included when it gave one): the run may still be training, and a new
        connection with ``since=<last seq>`` picks the stream up again.
        """
        while self._events.done is None:
            try:
                msg = read_message(self._reader)
            except TimeoutError:
                raise self._events.silent(self._silence) from None
            except (OSError, ValueError) as exc:  # ValueError: read after close()
                if self._closed.is_set():
                    msg = None
                else:
                    raise LifelineError(
                        f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                    ) from None
            if msg is None and self._closed.is_set():
                raise LifelineError(f"the lifeline to run {self.run_id} was closed by its owner")
            event = self._events.take(msg)
            if event is not None:
                yield event

    @property
    def done(self) -> RunStatus | None:
        """The final status once :meth:`events` yielded it."""
        return self._events.done

    def stop(self) -> None:
        """End the run now: its supervisor tears it down (its state becomes failed, "stopped by its owner")."""
        self._command("stop")

    def detach(self) -> None:
        """Leave on purpose: the run waits ``reattach_timeout`` for its next owner."""
        self._command("detach")

    def release(self) -> None:
        """The result is taken (or not wanted): the supervisor tears the ended run down."""
        self._command("release")

    def fetch_output(self, dest_dir: Path) -> Path | None:
        """Rank 0's output, once the run has ended, as ``dest_dir/output.pkl`` (0600) with the
        manifest beside it that :class:`~airflow_provider_torchdist.spark.output_store.OutputManifest`
        reads; None when the run has none (a script, a failed run).

        Reads the rest of the event stream first when :meth:`events` has not reached ``done``.
        The bytes are checked against the size and SHA-256 of the status; :class:`LifelineError`
        when they differ (nothing is left in ``dest_dir`` then).
        """
        for _ in self.events():
            pass
        status = self._events.done
        assert status is not None
        if status.output is None:
            return None
        expected = status.output
        self._send({"k": "fetch"})
        header = self._output_header()
        if header.manifest is None:
            raise LifelineError(
                f"the supervisor of run {self.run_id} has no output to send, though the run reported one: "
                f"{header.error or 'no reason given'}"
            )
        if header.manifest != expected:
            raise LifelineError(
                f"the supervisor of run {self.run_id} sent an output manifest {header.manifest} that is not the "
                f"run's {expected}"
            )
        part = Path(dest_dir) / ".torchdist-output-fetch.part"
        digest = hashlib.sha256()
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                left = expected["size"]
                while left:
                    try:
                        chunk = self._reader.read(min(_CHUNK, left))
                    except TimeoutError:
                        raise self._events.silent(self._silence) from None
                    except OSError as exc:
                        raise LifelineError(f"the output of run {self.run_id} broke off: {exc}") from None
                    if not chunk:
                        raise LifelineError(
                            f"the output of run {self.run_id} broke off after {expected['size'] - left} of "
                            f"{expected['size']} bytes"
                        )
                    digest.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            if digest.hexdigest() != expected["sha256"]:
                raise LifelineError(
                    f"the output of run {self.run_id} does not match its SHA-256 {expected['sha256']}: it is not used"
                )
            return publish_output(
                part,
                Path(dest_dir),
                format=expected["format"],
                type=expected["type"],
                sha256=expected["sha256"],
                generation="lifeline",
            )
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    def _output_header(self) -> _OutputHeader:
        while True:
            try:
                msg = read_message(self._reader)
            except TimeoutError:
                raise self._events.silent(self._silence) from None
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} broke while fetching its output: {exc}"
                ) from None
            if msg is None:
                why = f": {self._events.closing}" if self._events.closing else ""
                raise LifelineError(
                    f"the supervisor of run {self.run_id} closed the lifeline before sending the output{why}"
                )
            parsed = parse_server_message(msg)
            if isinstance(parsed, _OutputHeader):
                return parsed
            if isinstance(parsed, ErrorEvent):
                raise LifelineError(
                    f"the supervisor of run {self.run_id} did not send the output: {parsed.message}"
                )
            if isinstance(parsed, _Closing):
                self._events.closing = parsed.reason

    def _command(self, name: str) -> None:
        try:
            self._send({"k": name})
        except LifelineError:
            # After "done" the run is over either way: a lifeline the supervisor already closed
            # (it tore the run down) is not worth an error.
            if self._events.done is None:
                raise

    def _send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        with self._write_lock:
            if self._closed.is_set():
                raise LifelineError(f"the lifeline to run {self.run_id} is closed")
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None

    def _ping(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self._send({"k": "ping"})
            except LifelineError:
                return

    def close(self) -> None:
        """Close the lifeline (an ``events()`` loop in another thread ends with :class:`LifelineError`).

        Closing without ``detach`` or ``release`` counts as a lost owner."""
        with self._write_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._reader.close()
        self._sock.close()

    def __enter__(self) -> OwnerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_status(
    host: str, port: int, run_id: str, secret: bytes, timeout: float = HELLO_TIMEOUT_S
) -> RunStatus:
    """The run's status, without becoming its owner (:class:`RunGone` when no supervisor is there)."""
    handshake = _ClientHandshake(host, port, run_id, secret, "status", 0)
    sock, reader, status = _connect(handshake, host, port, timeout)
    reader.close()
    sock.close()
    return status


# -- the async client -----------------------------------------------------------------------------


class AsyncOwnerConnection:
    """:class:`OwnerConnection` on asyncio streams, for a trigger.

    Example::

        conn = await AsyncOwnerConnection.connect(host, port, run_id, secret, kind="trigger", since=n)
        async for event in conn.events():
            ...
        await conn.detach()
        await conn.close()
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        run_id: str,
        kind: str,
        where: str,
        status: RunStatus,
        silence: float,
        ping_interval: float,
    ) -> None:
        """Use :meth:`connect` (this takes a connection already authenticated)."""
        self._reader, self._writer = reader, writer
        self.run_id, self.kind, self.where, self.status = run_id, kind, where, status
        self._silence = silence
        self._events = _Events(run_id, where)
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._pinger: asyncio.Task[None] | None = None
        if kind in OWNER_KINDS:
            self._pinger = asyncio.get_running_loop().create_task(self._ping(ping_interval))

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        run_id: str,
        secret: bytes,
        *,
        kind: str = "trigger",
        since: int = 0,
        timeout: float = HELLO_TIMEOUT_S,
        ping_interval: float = PING_INTERVAL_S,
        silence: float = OWNER_SILENCE_S,
    ) -> AsyncOwnerConnection:
        """Connect and authenticate both ways; raises as :class:`OwnerConnection` does."""
        handshake = _ClientHandshake(host, port, run_id, secret, kind, since)
        deadline = time.monotonic() + timeout
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=MAX_LINE_BYTES + 1), timeout
            )
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            raise handshake.gone(str(exc)) from None
        except (TimeoutError, OSError) as exc:
            raise handshake.unreachable(str(exc) or type(exc).__name__) from None

        async def receive() -> dict[str, Any] | None:
            return await _read_async(reader, max(0.0, deadline - time.monotonic()))

        try:
            try:
                writer.write(handshake.hello())
                await writer.drain()
                challenge = await receive()
            except ConnectionResetError as exc:
                raise handshake.gone(str(exc)) from None
            writer.write(handshake.answer(challenge))
            await writer.drain()
            status = handshake.welcome(await receive())
        except LifelineError:
            writer.close()
            raise
        except TimeoutError:
            writer.close()
            raise handshake.unreachable(f"no handshake within {timeout:g} s") from None
        except OSError as exc:
            writer.close()
            raise LifelineError(f"the lifeline to run {run_id} at {handshake.where} broke: {exc}") from None
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, run_id, kind, handshake.where, status, silence, ping_interval)

    async def events(self) -> AsyncIterator[Event]:
        """As :meth:`OwnerConnection.events`."""
        while self._events.done is None:
            try:
                msg = await _read_async(self._reader, self._silence)
            except TimeoutError:
                raise self._events.silent(self._silence) from None
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None
            event = self._events.take(msg)
            if event is not None:
                yield event

    async def stop(self) -> None:
        await self._command("stop")

    async def detach(self) -> None:
        await self._command("detach")

    async def release(self) -> None:
        await self._command("release")

    async def _command(self, name: str) -> None:
        try:
            await self._send({"k": name})
        except LifelineError:
            if self._events.done is None:
                raise

    async def _send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        async with self._write_lock:
            if self._closed:
                raise LifelineError(f"the lifeline to run {self.run_id} is closed")
            try:
                self._writer.write(data)
                await self._writer.drain()
            except OSError as exc:
                raise LifelineError(
                    f"the lifeline to run {self.run_id} at {self.where} broke: {exc}"
                ) from None

    async def _ping(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self._send({"k": "ping"})
            except LifelineError:
                return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pinger
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 2.0)

    async def __aenter__(self) -> AsyncOwnerConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _read_async(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any] | None:
    try:
        raw = await asyncio.wait_for(reader.readline(), timeout)
    except ValueError:  # asyncio's own "over the limit" (LimitOverrunError)
        raise MalformedMessage(f"a message of more than {MAX_LINE_BYTES} bytes was refused") from None
    if not raw.endswith(b"\n"):
        return None
    return decode(raw)


# -- the supervisor's side ------------------------------------------------------------------------


class _Subscription:
    """One owner's queue: encoded events from :class:`RunState` (counted, dropped beyond ``limit``)
    and the session's own items (``CLOSE``, ``FETCH``, an error message as ``_Raw``)."""

    CLOSE = object()
    FETCH = object()

    def __init__(self, limit: int) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._dropped = 0
        self._limit = limit

    def offer(self, data: bytes) -> None:
        with self._lock:
            if self._pending >= self._limit:
                self._dropped += 1
                return
            self._pending += 1
        self.items.put(data)

    def took(self) -> int:
        """One offered event was taken; returns how many were dropped since the last one."""
        with self._lock:
            self._pending -= 1
            dropped, self._dropped = self._dropped, 0
            return dropped


@dataclass(frozen=True)
class _Raw:
    data: bytes


class RunState:
    """What the supervisor knows of its run; the lifeline serves it. Thread-safe, no sockets.

    The supervisor feeds it (``add_line``, ``set_application``, ``add_metric``, ``set_running``,
    ``finish``); every owner's stream is a subscription to it (``subscribe``).
    """

    def __init__(self, replay_lines: int = REPLAY_LINES, queue_limit: int = OWNER_QUEUE_LIMIT) -> None:
        self._lock = threading.Lock()
        self._lines: deque[tuple[int, bytes]] = deque(maxlen=replay_lines)
        self._seq = 0
        self._state = "starting"
        self._app: tuple[str, str | None] | None = None
        self._error: str | None = None
        self._error_kind: str | None = None
        self._failures: list[dict[str, Any]] = []
        self._metrics: list[dict[str, Any]] = []
        self._output: dict[str, Any] | None = None
        self._output_path: Path | None = None
        self._subscribers: list[_Subscription] = []
        self._queue_limit = queue_limit

    # -- fed by the supervisor

    def add_line(self, text: str) -> int:
        """Keep and send one log line; returns its sequence number."""
        if len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + " [torchdist: line cut]"
        with self._lock:
            self._seq += 1
            data = encode({"k": "line", "seq": self._seq, "text": text})
            self._lines.append((self._seq, data))
            self._publish(data)
            return self._seq

    def set_application(self, app_id: str, ui_url: str | None) -> None:
        with self._lock:
            self._app = (app_id, ui_url)
            self._publish(encode({"k": "app", "app_id": app_id, "ui_url": ui_url}))

    def add_metric(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._metrics.append(record)
            with contextlib.suppress(MalformedMessage, TypeError, ValueError):
                self._publish(encode({"k": "metric", "m": record}))

    def set_running(self) -> None:
        with self._lock:
            if self._state == "starting":
                self._state = "running"

    def finish(
        self,
        state: str,
        *,
        error: str | None = None,
        error_kind: str | None = None,
        failures: list[dict[str, Any]] | None = None,
        metrics: list[dict[str, Any]] | None = None,
        output: dict[str, Any] | None = None,
        output_path: Path | None = None,
    ) -> bool:
        """The run has ended: every owner gets ``done``. False (and nothing changes) if it had already.
        A failed run's ``error_kind`` is ``"run"`` unless told (``"training"``)."""
        if state not in ENDED_STATES:
            raise ValueError(f"a run ends as one of {ENDED_STATES}, not {state!r}")
        if error_kind not in ERROR_KINDS:
            raise ValueError(f"error_kind is one of {ERROR_KINDS}, not {error_kind!r}")
        with self._lock:
            if self._state in ENDED_STATES:
                return False
            self._state, self._error = state, error
            self._error_kind = (error_kind or "run") if state == "failed" else None
            self._failures = [_trimmed_failure(f) for f in failures or []]
            if metrics is not None:
                self._metrics = list(metrics)
            self._output, self._output_path = output, output_path
            self._publish(self._done_message())
            return True

    # -- read by the lifeline

    @property
    def state(self) -> str:
        return self._state

    @property
    def ended(self) -> bool:
        return self._state in ENDED_STATES

    def status(self) -> RunStatus:
        with self._lock:
            return self._status()

    def output(self) -> tuple[dict[str, Any] | None, Path | None]:
        """Rank 0's output as the status describes it, and the file holding it."""
        with self._lock:
            return self._output, self._output_path

    def subscribe(self, since: int) -> tuple[RunStatus, _Subscription]:
        """The status now and a stream that starts with what an owner has not seen: kept lines
        after ``since``, the application, and ``done`` if the run has ended."""
        with self._lock:
            sub = _Subscription(self._queue_limit)
            if self._app is not None:
                sub.offer(encode({"k": "app", "app_id": self._app[0], "ui_url": self._app[1]}))
            for seq, data in self._lines:
                if seq > since:
                    sub.offer(data)
            if self._state in ENDED_STATES:
                sub.offer(self._done_message())
            self._subscribers.append(sub)
            return self._status(), sub

    def unsubscribe(self, sub: _Subscription) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._subscribers.remove(sub)

    # -- internals (under the lock)

    def _publish(self, data: bytes) -> None:
        for sub in self._subscribers:
            sub.offer(data)

    def _status(self) -> RunStatus:
        app_id, ui_url = self._app or (None, None)
        return RunStatus(
            state=self._state,
            app_id=app_id,
            ui_url=ui_url,
            error=self._error,
            error_kind=self._error_kind,
            failures=list(self._failures),
            metrics=_newest_that_fit(self._metrics, METRICS_BUDGET_BYTES),
            output=self._output,
            last_seq=self._seq,
        )

    def _done_message(self) -> bytes:
        return encode({"k": "done", "status": self._status().to_dict()})


def _trimmed_failure(failure: dict[str, Any]) -> dict[str, Any]:
    """A failure that fits in a status: the tail of its traceback, the head of its message."""
    failure = dict(failure)
    if isinstance(failure.get("traceback"), str) and len(failure["traceback"]) > FAILURE_TRACEBACK_CHARS:
        failure["traceback"] = "...\n" + failure["traceback"][-FAILURE_TRACEBACK_CHARS:]
    if isinstance(failure.get("message"), str) and len(failure["message"]) > FAILURE_MESSAGE_CHARS:
        failure["message"] = failure["message"][:FAILURE_MESSAGE_CHARS] + " [cut]"
    return failure


def _newest_that_fit(records: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    kept: list[dict[str, Any]] = []
    for record in reversed(records):
        try:
            size = len(json.dumps(record, separators=(",", ":"))) + 1
        except (TypeError, ValueError):
            continue
        if size > budget:
            break
        budget -= size
        kept.append(record)
    kept.reverse()
    return kept


class OwnerListener(Protocol):
    """What the supervisor hears from the lifeline about its owners (called from server threads)."""

    def owner_attached(self, owner: OwnerSession) -> None: ...

    def owner_command(self, owner: OwnerSession, command: str) -> str | None:
        """``stop``, ``detach`` or ``release``; a returned text is sent back as an error."""
        ...

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        """The session ended (closed, broke, silent, or closed by the supervisor); once per session."""
        ...


class _AnyOwner:
    """The listener of a server nobody supervises (tests of the protocol): every command is fine."""

    def owner_attached(self, owner: OwnerSession) -> None:
        pass

    def owner_command(self, owner: OwnerSession, command: str) -> str | None:
        return None

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        pass


class OwnerSession:
    """One authenticated owner connection, on the supervisor's side.

    Its own thread sends the subscription's events (and pings when idle); the connection's thread
    reads the owner's commands. ``close(reason)`` sends what is queued, then ``closing``, then closes.
    """

    def __init__(
        self,
        server: LifelineServer,
        sock: socket.socket,
        kind: str,
        peer: str,
        sub: _Subscription,
    ) -> None:
        self.kind = kind
        self.peer = peer
        self.detached = False
        self._server = server
        self._sock = sock
        self._sub = sub
        self._closing: str | None = None
        self._writer = threading.Thread(target=self._write_loop, name="torchdist-lifeline-send", daemon=True)

    def __repr__(self) -> str:
        return f"<owner {self.kind} from {self.peer}>"

    def send_error(self, message: str) -> None:
        self._sub.items.put(_Raw(encode({"k": "error", "message": message})))

    def close(self, reason: str) -> None:
        """Send what is queued and ``{"k": "closing", "reason": reason}``, then close the connection."""
        if self._closing is None:
            self._closing = reason
            self._sub.items.put(_Subscription.CLOSE)

    def fetch(self) -> None:
        self._sub.items.put(_Subscription.FETCH)

    def start_sending(self) -> None:
        """Start the thread that sends this owner its events."""
        self._writer.start()

    def wait_sent(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until the sending thread is done, after :meth:`close`."""
        if self._writer.ident is not None:
            self._writer.join(timeout)

    def _write_loop(self) -> None:
        sock, sub = self._sock, self._sub
        try:
            while True:
                try:
                    item = sub.items.get(timeout=self._server.ping_interval)
                except queue.Empty:
                    sock.sendall(encode({"k": "ping"}))
                    continue
                if item is _Subscription.CLOSE:
                    sock.sendall(encode({"k": "closing", "reason": self._closing or "closed"}))
                    return
                if item is _Subscription.FETCH:
                    self._send_output()
                elif isinstance(item, _Raw):
                    sock.sendall(item.data)
                else:
                    dropped = sub.took()
                    if dropped:
                        notice = f"{dropped} event(s) were not sent: this owner fell behind"
                        sock.sendall(encode({"k": "error", "message": notice}))
                    sock.sendall(item)
        except OSError:
            pass  # gone, or stalled past the timeout: the reader sees the connection end
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _send_output(self) -> None:
        manifest, path = self._server.state.output()
        if manifest is None or path is None:
            self._sock.sendall(encode({"k": "output", "manifest": None}))
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            self._sock.sendall(
                encode({"k": "output", "manifest": None, "error": f"cannot open {path}: {exc.strerror}"})
            )
            return
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != manifest["size"]:
                error = f"{path} holds {size} bytes, not the {manifest['size']} its manifest says"
                self._sock.sendall(encode({"k": "output", "manifest": None, "error": error}))
                return
            self._sock.sendall(encode({"k": "output", "manifest": manifest}))
            if size:
                self._sock.sendfile(f, 0, size)

    def read_commands(self, reader: BinaryIO) -> str:
        """Read commands until the owner is gone; returns why it is."""
        listener = self._server.listener
        while True:
            try:
                msg = read_message(reader)
            except TimeoutError:
                return f"it sent nothing for {self._server.silence_s:g} s"
            except MalformedMessage as exc:
                self.close(f"a malformed message: {exc}")
                return f"it sent a malformed message ({exc})"
            except (OSError, ValueError) as exc:
                return self._why_closed(f"its connection broke ({exc})")
            if msg is None:
                return self._why_closed("it closed the connection")
            try:
                command = parse_command(msg)
            except MalformedMessage as exc:
                self.send_error(str(exc))
                continue
            if command == "ping":
                continue
            if command == "fetch":
                if not self._server.state.ended:
                    self.send_error("the run has not ended: its output is fetched after 'done'")
                else:
                    self.fetch()
                continue
            if command == "detach":
                self.detached = True
            error = listener.owner_command(self, command)
            if error:
                self.send_error(error)

    def _why_closed(self, default: str) -> str:
        return f"the supervisor closed it ({self._closing})" if self._closing else default


class LifelineServer:
    """The supervisor's lifeline: binds ``bind_host`` on a free port at once; :meth:`start` serves.

    Authenticates every connection (both ways), answers ``status`` queries, and streams ``state``
    to owners; what owners do goes to ``listener``. Example::

        server = LifelineServer(run_id, secret, "127.0.0.1", state, supervisor)
        host, port = server.address
        server.start()
        ...
        server.close("the run was torn down")
    """

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        bind_host: str,
        state: RunState | None = None,
        listener: OwnerListener | None = None,
        *,
        silence_s: float = OWNER_SILENCE_S,
        ping_interval: float = PING_INTERVAL_S,
        hello_timeout: float = HELLO_TIMEOUT_S,
        max_pending: int = MAX_PENDING_HELLOS,
    ) -> None:
        self.run_id = _check_run_id(run_id)
        self._secret = _check_secret(secret)
        self.state = state if state is not None else RunState()
        self.listener: OwnerListener = listener if listener is not None else _AnyOwner()
        self.silence_s, self.ping_interval, self.hello_timeout = silence_s, ping_interval, hello_timeout
        family = socket.getaddrinfo(bind_host, 0, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((bind_host, 0), family=family)
        self._sock.settimeout(0.25)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._pending = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._sessions: set[OwnerSession] = set()
        self._connections: set[socket.socket] = set()
        self._accepting = True
        self._close_reason = "the supervisor is closing"
        self._thread = threading.Thread(target=self._accept_loop, name="torchdist-lifeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """From now on a new connection is refused (an owner is told the run is gone)."""
        with self._lock:
            self._accepting = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def close(self, reason: str, timeout: float = 2.0) -> None:
        """Stop accepting; every owner gets what is queued and ``closing`` (up to ``timeout``)."""
        self._close_reason = reason
        self.stop_accepting()
        with self._lock:
            sessions, connections = list(self._sessions), list(self._connections)
        for session in sessions:
            session.close(reason)
        deadline = time.monotonic() + timeout
        for session in sessions:
            session.wait_sent(max(0.0, deadline - time.monotonic()))
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(
                        encode(
                            {"error": "too many connections are authenticating; try again", "code": "busy"}
                        )
                    )
                conn.close()
                continue
            with self._lock:
                if not self._accepting:
                    self._pending.release()
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve,
                args=(conn, f"{peer[0]}:{peer[1]}"),
                name="torchdist-lifeline-conn",
                daemon=True,
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            try:
                hello = self._handshake(conn)
            finally:
                self._pending.release()
            if hello is not None:
                self._own(conn, peer, hello)
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _refuse(self, conn: socket.socket, error: str, code: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(encode({"error": error, "code": code}))

    def _handshake(self, conn: socket.socket) -> tuple[str, int, str] | None:
        """``(kind, since, the supervisor's proof)`` for an authenticated client; None after a refusal."""
        deadline = time.monotonic() + self.hello_timeout

        def receive() -> dict[str, Any]:
            return decode(read_line(conn, deadline, _MAX_HELLO_BYTES))

        try:
            hello = receive()
            version = hello.get("v")
            if not _is_int(version) or version != LIFELINE_VERSION:
                self._refuse(
                    conn,
                    f"this supervisor speaks lifeline version {LIFELINE_VERSION}, the client {version!r}: owner and "
                    "supervisor come from different airflow-provider-torchdist versions",
                    "version",
                )
                return None
            _exact_keys(hello, {"v", "run_id", "kind", "since", "nonce"}, "malformed hello")
            run_id, kind, since, client_nonce = hello["run_id"], hello["kind"], hello["since"], hello["nonce"]
            _require(isinstance(run_id, str) and bool(run_id), "malformed hello: bad run_id")
            _require(kind in KINDS, f"malformed hello: kind must be one of {', '.join(KINDS)}")
            _require(_is_int(since) and since >= 0, "malformed hello: bad since")
            _require(
                isinstance(client_nonce, str) and bool(_NONCE.fullmatch(client_nonce)),
                "malformed hello: bad nonce",
            )
            if run_id != self.run_id:
                self._refuse(conn, f"this supervisor runs run {self.run_id}, not {run_id}", "wrong_run")
                return None
            server_nonce = secrets.token_hex(16)
            conn.sendall(encode({"nonce": server_nonce}))
            answer = receive()
            _exact_keys(answer, {"proof"}, "malformed proof")
            expected = owner_proof(self._secret, run_id, kind, server_nonce, client_nonce)
            if not isinstance(answer["proof"], str) or not hmac.compare_digest(answer["proof"], expected):
                self._refuse(conn, "the owner's credentials were refused", "refused")
                return None
        except MalformedMessage as exc:
            self._refuse(conn, str(exc), "malformed")
            return None
        except HelloRefused:
            return None
        return kind, since, supervisor_proof(self._secret, run_id, client_nonce, server_nonce)

    def _own(self, conn: socket.socket, peer: str, hello: tuple[str, int, str]) -> None:
        kind, since, proof = hello
        if kind == "status":
            conn.sendall(encode({"ok": True, "proof": proof, "status": self.state.status().to_dict()}))
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            return
        status, sub = self.state.subscribe(since)
        session = OwnerSession(self, conn, kind, peer, sub)
        try:
            conn.settimeout(self.silence_s)
            conn.sendall(encode({"ok": True, "proof": proof, "status": status.to_dict()}))
            with self._lock:
                accepting = self._accepting
                if accepting:
                    self._sessions.add(session)
                    session.start_sending()
            if not accepting:  # closed meanwhile
                conn.sendall(encode({"k": "closing", "reason": self._close_reason}))
                return
            reader = conn.makefile("rb")
            why = "it never got going"
            try:
                self.listener.owner_attached(session)
                why = session.read_commands(reader)
            finally:
                session.close(why)
                session.wait_sent(self.silence_s)
                reader.close()
                self.listener.owner_lost(session, why)
        finally:
            self.state.unsubscribe(sub)
            with self._lock:
                self._sessions.discard(session)


__all__ = [
    "AppEvent",
    "AsyncOwnerConnection",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "HELLO_TIMEOUT_S",
    "LIFELINE_VERSION",
    "LifelineError",
    "LifelineServer",
    "LifelineUnreachable",
    "LineEvent",
    "MetricEvent",
    "OWNER_SILENCE_S",
    "OwnerConnection",
    "OwnerListener",
    "OwnerSession",
    "PING_INTERVAL_S",
    "REPLAY_LINES",
    "RunGone",
    "RunState",
    "RunStatus",
    "query_status",
]
