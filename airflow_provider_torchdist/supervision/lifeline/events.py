"""What an owner gets after the handshake: the event classes, the strict parsing of the
supervisor's messages (and of an owner's commands, on the supervisor's side), and :class:`_Events`,
which both clients use to turn the message stream into events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_provider_torchdist.spark.wire.connect_ids import split_operation
from airflow_provider_torchdist.spark.wire.logsafe import escape_controls
from airflow_provider_torchdist.supervision.lifeline.messages import (
    COMMANDS,
    MAX_WHY_CHARS,
    LifelineError,
    MalformedMessage,
    _exact_keys,
    _is_int,
    _opt_str,
    _require,
)
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus, _valid_output

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
    #: Over Spark Connect, the run's operation: ``<session id>/<operation id>``.
    operation: str | None = None


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
        _exact_keys(msg, {"k", "app_id", "ui_url"}, "malformed 'app' message", optional={"operation"})
        operation = msg.get("operation")
        _require(
            isinstance(msg["app_id"], str)
            and bool(msg["app_id"])
            and _opt_str(msg["ui_url"])
            and (operation is None or split_operation(operation) is not None),
            "malformed 'app'",
        )
        return AppEvent(msg["app_id"], msg["ui_url"], operation)
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


def parse_command(msg: dict[str, Any]) -> tuple[str, str | None]:
    """An owner's command (one of ``COMMANDS``) and, for ``stop``, why it stops the run ("timeout",
    "killed"; None when it does not say); :class:`MalformedMessage` otherwise."""
    _exact_keys(msg, {"k"}, "malformed command", optional={"why"} if msg.get("k") == "stop" else set())
    _require(msg["k"] in COMMANDS, f"unknown command {msg['k']!r} (one of {', '.join(COMMANDS)})")
    why = msg.get("why")
    _require(
        why is None or (isinstance(why, str) and 0 < len(why) <= MAX_WHY_CHARS),
        f"malformed 'stop': why must be a string of 1 to {MAX_WHY_CHARS} characters",
    )
    return msg["k"], escape_controls(why) if why is not None else None


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
            raise self.closed(f" at {self.where}", "the run ended")
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

    def closed(self, at: str, before: str) -> LifelineError:
        """The supervisor closed the lifeline ``before`` something, with its reason if it gave one."""
        why = f": {self.closing}" if self.closing else ""
        return LifelineError(
            f"the supervisor of run {self.run_id}{at} closed the lifeline before {before}{why}"
        )

    def silent(self, seconds: float) -> LifelineError:
        return LifelineError(
            f"the supervisor of run {self.run_id} at {self.where} sent nothing for {seconds:g} s: the network "
            "or its machine is down"
        )
