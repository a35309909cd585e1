"""The run channel's messages: one dataclass per kind, one encoder, one decoder.

Both ends import this module: ranks and agents (:mod:`~airflow_provider_torchdist.spark.node.channel_client`),
the driver (:mod:`~airflow_provider_torchdist.spark.driver.channel`) and the Airflow side's owner stream
(:mod:`~airflow_provider_torchdist.spark.driver.owner`). On the wire each message is one JSON line whose
``"k"`` names its kind; an :class:`Output` header is followed by its ``size`` raw bytes.

Example::

    data = encode(Line("out", "epoch 1"))     # b'{"k": "line", "s": "out", "l": "epoch 1"}\\n'
    decode(data) == Line("out", "epoch 1")

:func:`decode` checks every field's type: anything malformed raises :class:`ProtocolError` (a
``ValueError``) that says which message and field. Standard library only.
"""

# size: the catalog of the run channel's messages, one small dataclass per kind: read whole, it is
# the protocol; split, its kinds would hide from each other.

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from airflow_provider_torchdist.spark.wire.connect_ids import split_operation
from airflow_provider_torchdist.spark.wire.json_lines import json_object
from airflow_provider_torchdist.spark.wire.message import Message, ProtocolError, checked_field
from airflow_provider_torchdist.spark.wire.outcome import RankFailure

# The hang watchdog's kinds: imported before ``_KINDS`` is made, so that decode() knows them.
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress as Progress
from airflow_provider_torchdist.spark.wire.watchdog_messages import StackRequest as StackRequest
from airflow_provider_torchdist.spark.wire.watchdog_messages import Stacks as Stacks

#: The longest reason a :class:`StopRequest` carries (the stopper's own words, cut to fit).
STOP_REASON_CHARS = 200


def rank_prefix(rank: int | None, host: str | None) -> str:
    """The prefix every forwarded line carries in the task log: ``[rank 1 @ 10.0.0.2]``."""
    who = "agent" if rank is None else f"rank {rank}"
    return f"[{who} @ {host}]" if host else f"[{who}]"


_STR, _INT, _NUMBER = (str,), (int,), (int, float)
#: What an output's header says of its bytes; the output store checks the values.
_META_SCHEMA = tuple((name, name, _STR, True) for name in ("format", "type", "sha256"))
_FAILURE_INTS = ("rank", "local_rank", "exitcode")
_FAILURE_FIELDS = tuple(f.name for f in dataclasses.fields(RankFailure))
#: The fields of a :class:`RankFailure` that a rank reports about its own exception.
_RANK_ERROR_FIELDS = tuple(f for f in _FAILURE_FIELDS if f not in ("rank", "host"))


def _failure_to_wire(failure: RankFailure, fields: tuple[str, ...]) -> dict[str, Any]:
    """A failure's fields as JSON, each coerced to its type so that the decoder's checks pass."""
    values = {name: getattr(failure, name) for name in fields}
    return {
        name: (value if type(value) is int else None)
        if name in _FAILURE_INTS
        else (None if value is None else str(value))
        for name, value in values.items()
    }


def _failure_from_wire(obj: Any, kind: str, fields: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{kind!r} message: a failure must be an object, got {type(obj).__name__}")
    unknown = set(obj) - set(fields)
    if unknown:
        raise ProtocolError(f"{kind!r} message: unknown failure field(s) {sorted(unknown)}")
    return {
        name: checked_field(obj, kind, name, _INT if name in _FAILURE_INTS else _STR, True) for name in obj
    }


@dataclass(frozen=True)
class Line(Message):
    """One line a rank printed (``stream``: ``"out"`` or ``"err"``), forwarded to the task log."""

    KIND = "line"
    SCHEMA = (("stream", "s", _STR, False), ("text", "l", _STR, False))
    stream: str
    text: str

    def check(self) -> None:
        if self.stream not in ("out", "err"):
            raise ProtocolError(f"'line' message: stream must be 'out' or 'err', got {self.stream!r}")


@dataclass(frozen=True)
class RankError(Message):
    """The exception a rank raised; the driver adds the rank and host it verified."""

    KIND = "error"
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    local_rank: int | None = None
    signal: str | None = None

    def failure(self, rank: int, host: str | None) -> RankFailure:
        return RankFailure(rank=rank, host=host, **{f: getattr(self, f) for f in _RANK_ERROR_FIELDS})

    def to_wire(self) -> dict[str, Any]:
        return {"e": _failure_to_wire(self.failure(0, None), _RANK_ERROR_FIELDS)}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> RankError:
        return cls(**_failure_from_wire(obj.get("e"), cls.KIND, _RANK_ERROR_FIELDS))


@dataclass(frozen=True)
class AgentFailures(Message):
    """A node's agent's verdict that its node failed: one record per failed rank (or for itself)."""

    KIND = "failures"
    failures: tuple[RankFailure, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"failures": [_failure_to_wire(f, _FAILURE_FIELDS) for f in self.failures]}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> AgentFailures:
        items = checked_field(obj, cls.KIND, "failures", (list,))
        fields = (_failure_from_wire(f, cls.KIND, _FAILURE_FIELDS) for f in items)
        return cls(tuple(RankFailure(**{"rank": None, **f}) for f in fields))


@dataclass(frozen=True)
class NodeStarted(Message):
    """An agent's barrier task started: the n-th of a node belongs to the n-th stage attempt."""

    KIND = "node"


@dataclass(frozen=True)
class NodeLeft(Message):
    """An elastic run's agent was stopped by Spark (its executor went away, its task was killed):
    the node leaves the run, and its peers must meet again without it."""

    KIND = "node_left"


@dataclass(frozen=True)
class MasterEndpoint(Message):
    """Barrier task 0's rendezvous endpoint, for the other tasks of its stage attempt."""

    KIND = "master"
    SCHEMA = (("host", "host", _STR, False), ("port", "port", _INT, False))
    host: str
    port: int

    def check(self) -> None:
        if not self.host or not 0 < self.port < 65536:
            raise ProtocolError(f"'master' message: bad endpoint {self.host!r}:{self.port}")


@dataclass(frozen=True)
class MasterQuery(Message):
    """An agent asks for task 0's endpoint, waiting up to ``timeout`` seconds for it."""

    KIND = "master?"
    SCHEMA = (("timeout", "timeout", _NUMBER, False),)
    timeout: float = 300.0

    def check(self) -> None:
        if not 0 <= self.timeout < 1e7:  # NaN fails this too
            raise ProtocolError(f"'master?' message: bad timeout {self.timeout}")


@dataclass(frozen=True)
class MasterAnswer(Message):
    """The driver's answer to a :class:`MasterQuery`: the endpoint, or why there is none."""

    KIND = "master!"
    SCHEMA = (("host", "host", _STR, True), ("port", "port", _INT, True), ("error", "error", _STR, True))
    host: str | None = None
    port: int | None = None
    error: str | None = None

    def check(self) -> None:
        if self.error is None and (self.host is None or self.port is None):
            raise ProtocolError("'master!' message: neither an endpoint nor an error")


@dataclass(frozen=True)
class Metric(Message):
    """One ``report()`` record: ``{"rank", "step", "time", ["total_steps",] name: number, ...}``."""

    KIND = "metric"
    SCHEMA = (("record", "m", (dict,), False),)
    record: dict[str, Any]

    def check(self) -> None:
        for name, value in self.record.items():
            if value is not None and not isinstance(value, (str, int, float)):
                raise ProtocolError(
                    f"'metric' message: {name!r} must be a number, got {type(value).__name__}"
                )


@dataclass(frozen=True)
class Output(Message):
    """Header of rank 0's encoded value; its ``size`` bytes follow on the connection."""

    KIND = "output"
    SCHEMA = (("size", "n", _INT, False), *_META_SCHEMA)
    size: int
    format: str | None = None
    type: str | None = None
    sha256: str | None = None

    def check(self) -> None:
        if self.size < 0:
            raise ProtocolError(f"'output' message: bad output size {self.size}")


@dataclass(frozen=True)
class OutputFile(Message):
    """Rank 0 wrote its encoded value into the driver's output directory itself, as ``name``."""

    KIND = "output_file"
    SCHEMA = (("name", "name", _STR, False), *_META_SCHEMA)
    name: str
    format: str | None = None
    type: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class WorldSize(Message):
    """Global rank 0 of an elastic run's worker group: the group it starts has this many ranks."""

    KIND = "world_size"
    SCHEMA = (("world_size", "n", _INT, False),)
    world_size: int

    def check(self) -> None:
        if not 0 < self.world_size <= 1 << 20:
            raise ProtocolError(f"'world_size' message: bad world size {self.world_size}")


@dataclass(frozen=True)
class StopRequest(Message):
    """To a rank, from the driver: the run is being stopped (``reason``: "timeout", ...); the rank
    has ``grace`` seconds to checkpoint and return before what is left of the run is killed."""

    KIND = "stop"
    SCHEMA = (("reason", "reason", _STR, False), ("grace", "grace", _NUMBER, False))
    reason: str
    grace: float

    def check(self) -> None:
        if not 0 <= self.grace <= 7 * 24 * 3600:  # NaN fails this too
            raise ProtocolError(f"'stop' message: bad grace period {self.grace}")
        if len(self.reason) > STOP_REASON_CHARS:
            raise ProtocolError(f"'stop' message: a reason of {len(self.reason)} characters")


@dataclass(frozen=True)
class StopAnswer(Message):
    """A rank's answer to a :class:`StopRequest`: whether its code watches for stops (it has asked
    ``stop_requested()``, or handles the stop signal itself). When no rank does, waiting out the
    grace period would save nothing: the run is killed at once."""

    KIND = "stop!"
    SCHEMA = (("watching", "watching", (bool,), False),)
    watching: bool


@dataclass(frozen=True)
class Bye(Message):
    """A clean close: a connection that ends without one is reported in the log."""

    KIND = "bye"


@dataclass(frozen=True)
class LogLine(Message):
    """To an owner: one line of the task log, exactly as the driver prints it (escaped)."""

    KIND = "log"
    SCHEMA = (("text", "l", _STR, False),)
    text: str


@dataclass(frozen=True)
class Application(Message):
    """To an owner: the Spark application's id and its UI link (None when Spark has no UI); over
    Spark Connect, also the run's operation (:func:`connect_operation`: ``<session id>/<operation id>``)."""

    KIND = "application"
    SCHEMA = (
        ("app_id", "app_id", _STR, False),
        ("ui_url", "ui_url", _STR, True),
        ("operation", "operation", _STR, True),
    )
    app_id: str
    ui_url: str | None = None
    operation: str | None = None

    def check(self) -> None:
        if self.operation is not None and split_operation(self.operation) is None:
            raise ProtocolError(f"'application' message: {self.operation!r} is not a Connect operation")


def output_meta(msg: Output | OutputFile) -> dict[str, Any]:
    """What an output's header says of its bytes: ``format``, ``type`` and ``sha256``."""
    return {"format": msg.format, "type": msg.type, "sha256": msg.sha256}


#: What an owner connection receives.
OwnerEvent = LogLine | Application | Metric
_KINDS: dict[str, type[Message]] = {cls.KIND: cls for cls in Message.__subclasses__()}


def encode(msg: Message) -> bytes:
    """One message as its JSON line (an :class:`Output`'s bytes are sent after it)."""
    return json.dumps({"k": msg.KIND, **msg.to_wire()}).encode() + b"\n"


def decode(raw: bytes | str) -> Message:
    """The message in one JSON line; raises :class:`ProtocolError` for anything malformed."""
    obj = json_object(raw, ProtocolError)
    kind = obj.get("k")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    msg: Message = cls.from_wire(obj)
    return msg
