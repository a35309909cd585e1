"""How the task starts a run's supervisor: a fork of the task's process, or a new interpreter.

A fork (:mod:`~airflow_provider_torchdist.supervision.forked`, the default on Linux) starts with
Airflow and the Spark provider already imported, 1.2-1.3 s sooner than a new interpreter, which
imports them again. ``[torchdist] supervisor_start = exec`` (or a platform other than Linux) starts
``python -m airflow_provider_torchdist.supervision.supervisor <staging>`` instead. Either way the
supervisor leads a session of its own, its stdout and stderr go to ``<staging>/supervisor.log``,
and what the task gets back has ``pid``, ``poll()`` and ``wait()``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from airflow_provider_torchdist.submit.spark_submit import spark_side_environment
from airflow_provider_torchdist.supervision.config import LOG_FILE
from airflow_provider_torchdist.supervision.forked import can_fork, fork_detached, title_of
from airflow_provider_torchdist.supervision.processes import start_detached
from airflow_provider_torchdist.supervision.sweep import SUPERVISOR_MODULE

#: The values of ``[torchdist] supervisor_start``.
START_MODES = ("fork", "exec")


class Started(Protocol):
    """A started supervisor, as the task waits for it to listen."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


def start_mode() -> str:
    """``[torchdist] supervisor_start``: ``fork`` (default where the platform can) or ``exec``."""
    from airflow.configuration import conf

    mode = (conf.get("torchdist", "supervisor_start", fallback="fork") or "fork").strip().lower()
    if mode not in START_MODES:
        raise ValueError(
            f"[torchdist] supervisor_start must be one of {', '.join(START_MODES)}, not {mode!r}"
        )
    return mode if can_fork() else "exec"


def launch_supervisor(staging: Path) -> Started:
    """Start the supervisor of the run staged in ``staging`` (its files written already)."""
    log = staging / LOG_FILE
    if start_mode() == "fork":
        from airflow_provider_torchdist.supervision.supervisor import main

        return fork_detached(lambda: main([str(staging)]), log=log, title=title_of(staging))
    return start_detached(
        [sys.executable, "-m", SUPERVISOR_MODULE, str(staging)],
        env=supervisor_environment(os.environ),
        log=log,
    )


def supervisor_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The task's environment for a new supervisor interpreter, less the metadata DB it must not touch.

    Airflow's task runner blocks the task's own DB access with an unparsable
    ``SQL_ALCHEMY_CONN`` (``airflow-db-not-allowed:///``), which the supervisor would fail to import
    Airflow with. It needs no DB (the plan holds the resolved connection): an in-memory SQLite URL,
    never the deployment's database. What the task keeps to itself (its MLflow credentials) stays there."""
    env = spark_side_environment(environ)
    env.pop("AIRFLOW__CORE__SQL_ALCHEMY_CONN", None)
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = "sqlite://"
    return env
