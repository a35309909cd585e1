"""What the run's supervisor reads at its start, and what it names: its files, exit codes, start
errors and log line.

``<staging>/supervisor.json`` (:class:`SupervisorConfig`) and ``<staging>/plan.json``
(:func:`read_plan_text`) must be private files of this user (:func:`read_private`); whatever is
wrong with them is a :class:`SupervisorStartError`. The process around it is
:mod:`~airflow_provider_torchdist.supervision.supervisor`. Standard library only: nothing here imports Airflow.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.supervision.sweep import SUPERVISOR_FILE

PLAN_FILE = "plan.json"
ERROR_FILE = "supervisor.error"
LOG_FILE = "supervisor.log"
LOCK_FILE = ".torchdist-run.lock"
#: ``{"until": <epoch s>}``: the supervisor waits for an earlier run of its task to finish its stop
#: (its ranks' grace period) before it can take the lock; the task waits for it that much longer.
LOCK_WAIT_FILE = "supervisor.lock-wait"
EXIT_OK = 0
EXIT_START_FAILED = 2
EXIT_LOCKED = 3


class SupervisorStartError(Exception):
    """The supervisor cannot start the run; the text goes to ``supervisor.error``."""

    exit_code = EXIT_START_FAILED


class RunLocked(SupervisorStartError):
    """Another live run of the same task holds the checkpoint directory's lock."""

    exit_code = EXIT_LOCKED


def log(message: str) -> None:
    """One line of the supervisor's own log (its stdout is ``supervisor.log``). Best effort: on a
    full disk the line is lost, but the supervisor goes on (it still owns the run)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        print(f"{stamp} [torchdist supervisor] {message}", flush=True)
    except (OSError, ValueError):
        pass


# -- the settings ---------------------------------------------------------------------------------


def read_private(path: Path) -> str:
    """A file only this user can read or write: what the task handed over in it is secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SupervisorStartError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise SupervisorStartError(
                f"{path} must belong to this user (uid {os.getuid()}) and be private (0600); it is uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
            )
        return f.read()


@dataclass(frozen=True)
class SupervisorConfig:
    """``supervisor.json``: what the task hands its run's supervisor."""

    run_id: str
    durable: bool
    reattach_timeout: float
    bind_host: str
    checkpoint_dir: str | None
    owner_secret: bytes
    #: Rank 0's output file (in the staging directory); None for a script.
    output_file: Path | None
    #: Seconds the ranks get to checkpoint when the run is stopped (``stop_grace_period``).
    stop_grace_period: float
    #: The credential the lifeline accepts for ``status`` queries only (the Training view's:
    #: ``record.status_secret``); None: status queries need the owner's credential.
    status_secret: bytes | None = None

    @classmethod
    def from_dict(cls, data: Any) -> SupervisorConfig:
        keys = {
            "run_id",
            "durable",
            "reattach_timeout",
            "bind_host",
            "checkpoint_dir",
            "owner_secret_hex",
            "output_file",
            "stop_grace_period",
        }
        optional = {"status_secret_hex"}
        if not isinstance(data, dict) or not keys <= set(data) <= keys | optional:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise SupervisorStartError(
                f"{SUPERVISOR_FILE} must hold exactly {sorted(keys)} (and optionally {sorted(optional)}), "
                f"got {got}"
            )
        timeout, grace = data["reattach_timeout"], data["stop_grace_period"]
        secret = _secret_bytes(data["owner_secret_hex"])
        status_secret = _secret_bytes(data.get("status_secret_hex"))
        problems = [
            name
            for name, ok in (
                ("run_id", isinstance(data["run_id"], str) and 0 < len(data["run_id"]) <= 200),
                ("durable", type(data["durable"]) is bool),
                (
                    "reattach_timeout",
                    type(timeout) in (int, float) and math.isfinite(timeout) and timeout > 0,
                ),
                ("bind_host", isinstance(data["bind_host"], str) and bool(data["bind_host"])),
                (
                    "checkpoint_dir",
                    data["checkpoint_dir"] is None
                    or (isinstance(data["checkpoint_dir"], str) and data["checkpoint_dir"]),
                ),
                ("owner_secret_hex", len(secret) >= 32),
                ("status_secret_hex", "status_secret_hex" not in data or len(status_secret) >= 32),
                ("stop_grace_period", type(grace) in (int, float) and math.isfinite(grace) and grace >= 0),
                (
                    "output_file",
                    data["output_file"] is None
                    or (isinstance(data["output_file"], str) and os.path.isabs(data["output_file"])),
                ),
            )
            if not ok
        ]
        if problems:
            raise SupervisorStartError(f"{SUPERVISOR_FILE} has bad {', '.join(problems)}")
        return cls(
            run_id=data["run_id"],
            durable=data["durable"],
            reattach_timeout=float(timeout),
            bind_host=data["bind_host"],
            checkpoint_dir=data["checkpoint_dir"],
            owner_secret=secret,
            output_file=None if data["output_file"] is None else Path(data["output_file"]),
            stop_grace_period=float(grace),
            status_secret=status_secret if "status_secret_hex" in data else None,
        )

    @classmethod
    def read(cls, staging_dir: Path) -> SupervisorConfig:
        try:
            data = json.loads(read_private(staging_dir / SUPERVISOR_FILE))
        except ValueError as exc:
            raise SupervisorStartError(f"{SUPERVISOR_FILE} is not JSON: {exc}") from None
        return cls.from_dict(data)


def _secret_bytes(value: Any) -> bytes:
    """A credential handed over as hex; b"" when it is not (refused by the length check)."""
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""


def read_plan_text(staging_dir: Path) -> str:
    """``plan.json``, checked to be a private JSON object (the plan itself is built after the
    lifeline listens: importing the Spark provider takes a second)."""
    text = read_private(staging_dir / PLAN_FILE)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SupervisorStartError(f"{PLAN_FILE} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SupervisorStartError(f"{PLAN_FILE} must hold a JSON object, got {type(data).__name__}")
    return text
