"""Where a supervised run stands: :class:`RunStatus`, as the supervisor reports it and an owner
checks it (strictly: a status that is not what :meth:`RunStatus.to_dict` writes is refused)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_torchdist.spark.wire.connect_ids import split_operation
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.output_store import FORMATS
from airflow_provider_torchdist.spec import MAX_NUM_PROCESSES
from airflow_provider_torchdist.supervision.lifeline.messages import (
    ENDED_STATES,
    ERROR_KINDS,
    STATES,
    WORLD_SIZE_REASON_CHARS,
    _exact_keys,
    _is_int,
    _opt_str,
    _require,
)

_HEX64 = re.compile(r"[0-9a-f]{64}")

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


def _is_seconds(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


#: The keys of one entry of ``world_sizes`` (``Outcome.world_sizes``).
WORLD_SIZE_KEYS = frozenset({"time", "world_size", "reason"})


def valid_world_size(value: Any) -> bool:
    """One entry of ``world_sizes``: ``{"time": epoch seconds, "world_size": 1..MAX_NUM_PROCESSES, "reason": str}``
    (the reason at most ``WORLD_SIZE_REASON_CHARS``), nothing else."""
    return (
        isinstance(value, dict)
        and set(value) == WORLD_SIZE_KEYS
        and _is_seconds(value["time"])
        and _is_int(value["world_size"])
        and 1 <= value["world_size"] <= MAX_NUM_PROCESSES
        and isinstance(value["reason"], str)
        and len(value["reason"]) <= WORLD_SIZE_REASON_CHARS
    )


@dataclass(frozen=True)
class RunStatus:
    """Where a supervised run stands. ``failures`` are :class:`RankFailure` dicts; ``output`` is
    ``{"format", "type", "size", "sha256"}`` of rank 0's output (None: none, or not yet).
    ``error_kind`` says what failed, as the in-process path tells it apart: ``"training"`` (the
    driver reported the failed outcome: :class:`TrainingFailed`), ``"run"`` (spark-submit, the
    application or the supervisor ended it first: :class:`SparkSubmitFailed`); None unless failed.
    ``metrics`` is the ``report()`` history so far (the newest records that fit), live while the run
    trains. ``elapsed_s`` is how long the run has gone on since its supervisor started: its duration
    once it has ended. ``world_sizes`` is how the world size went over the run (``{"time",
    "world_size", "reason"}`` entries, the newest that fit), known once it has ended. ``operation``
    is a Spark Connect run's ``<session id>/<operation id>`` once its job runs."""

    state: str
    app_id: str | None = None
    ui_url: str | None = None
    operation: str | None = None
    error: str | None = None
    error_kind: str | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] | None = None
    last_seq: int = 0
    elapsed_s: float = 0.0
    world_sizes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (a ``TriggerEvent`` payload, a message); ``operation`` only when there is one,
        which an owner of an earlier release would not know."""
        operation = {"operation": self.operation} if self.operation else {}
        return {
            **operation,
            "state": self.state,
            "app_id": self.app_id,
            "ui_url": self.ui_url,
            "error": self.error,
            "error_kind": self.error_kind,
            "failures": [dict(f) for f in self.failures],
            "metrics": [dict(m) for m in self.metrics],
            "output": None if self.output is None else dict(self.output),
            "last_seq": self.last_seq,
            "elapsed_s": self.elapsed_s,
            "world_sizes": [dict(w) for w in self.world_sizes],
        }

    @classmethod
    def from_dict(cls, data: Any) -> RunStatus:
        """A status as :meth:`to_dict` wrote it; :class:`MalformedMessage` for anything else."""
        _require(isinstance(data, dict), f"a status must be an object, got {type(data).__name__}")
        # A supervisor of an earlier release (a run started before an upgrade) sends no elapsed_s
        # (nor world_sizes).
        data = {"elapsed_s": 0.0, "world_sizes": [], "operation": None, **data}
        _exact_keys(data, {f.name for f in dataclasses.fields(cls)}, "malformed status")
        problems = [
            name
            for name, ok in (
                ("state", data["state"] in STATES),
                ("app_id", data["app_id"] is None or (isinstance(data["app_id"], str) and data["app_id"])),
                ("ui_url", _opt_str(data["ui_url"])),
                ("operation", data["operation"] is None or split_operation(data["operation"]) is not None),
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
                ("elapsed_s", _is_seconds(data["elapsed_s"])),
                (
                    "world_sizes",
                    isinstance(data["world_sizes"], list) and all(map(valid_world_size, data["world_sizes"])),
                ),
            )
            if not ok
        ]
        _require(not problems, f"malformed status: bad {', '.join(problems)}")
        return cls(**data)
