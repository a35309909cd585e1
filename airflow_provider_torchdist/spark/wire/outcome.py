"""What a run ended with, as the driver records it for the hook (``outcome.json``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: In the staging directory: the driver's verdict, for the hook.
OUTCOME_FILE = "outcome.json"
#: A hung run's error starts with this (the driver's hang watch writes it; the Airflow side then
#: raises ``TrainingHung``, and the rest of the error says who hung and where: docs/hangs.md).
HUNG_ERROR_PREFIX = "training hung: "


@dataclass
class RankFailure:
    """One failed rank: where it ran, how it ended and, when it raised, the user's exception."""

    rank: int | None
    host: str | None = None
    local_rank: int | None = None
    exitcode: int | None = None
    #: Name of the signal that killed the rank (``SIGKILL``), when it died of one.
    signal: str | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None

    def summary(self) -> str:
        who = "a torchrun agent" if self.rank is None else f"rank {self.rank}"
        where = f" on {self.host}" if self.host else ""
        if self.exc_type:
            cause = f"{self.exc_type}: {self.message}" if self.message else self.exc_type
        elif self.signal:
            cause = f"killed by {self.signal}"
        elif self.exitcode is not None:
            cause = f"exited with code {self.exitcode}"
        else:
            cause = self.message or "failed"
        return f"{who}{where} failed: {cause}"

    def merge(self, other: RankFailure) -> RankFailure:
        """Fill the fields this record lacks from another record of the same rank."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in values.items():
            if value is None:
                values[name] = getattr(other, name)
        return RankFailure(**values)


@dataclass
class Outcome:
    """The driver's verdict on a run. ``ok`` is true only when every rank succeeded."""

    ok: bool
    failures: list[RankFailure] = field(default_factory=list)
    #: A failure that no rank owns (Spark job aborted, rendezvous timeout, driver error).
    error: str | None = None
    #: Hosts the torchrun agents ran on, by node rank.
    hosts: list[str] = field(default_factory=list)
    #: What training code reported with ``report()``, in arrival order.
    metrics: list[dict[str, Any]] = field(default_factory=list)
    #: The world size over the run: ``{"time": epoch seconds, "world_size": n, "reason": why}``,
    #: one entry at the start and one per change (elastic runs).
    world_sizes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, staging_dir: str | Path) -> None:
        # Written to a temporary name and renamed, so the hook never reads half a file.
        path = Path(staging_dir) / OUTCOME_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        os.replace(tmp, path)

    @classmethod
    def read(cls, staging_dir: str | Path) -> Outcome | None:
        path = Path(staging_dir) / OUTCOME_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["failures"] = [RankFailure(**f) for f in data.get("failures", [])]
        return cls(**data)
