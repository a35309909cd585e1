"""The Airflow side of a supervised run: start its supervisor, then own it over the lifeline.

A supervised run (the operator's path) is not a child of the task process. The task stages the
work and plans spark-submit as usual, then starts the run's supervisor in a session of its own
(:func:`start_supervisor`; a fork of the task's process, :mod:`~airflow_provider_torchdist.supervision.launch`). The supervisor runs spark-submit and keeps the
run's log, metrics and output; the task, a trigger or a retry owns it over the lifeline
(:mod:`~airflow_provider_torchdist.supervision.lifeline`) with the credential derived from the run id
(:func:`~airflow_provider_torchdist.supervision.record.owner_secret`). How long a run outlives a lost owner
is the supervisor's rule: at once for a non-durable run that loses its task, ``reattach_timeout``
otherwise.

Example::

    record = start_supervisor(staged, plan, durable=True, reattach_timeout=600.0)
    with connect_owner(record) as owner:
        for event in owner.events(): ...
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.errors import SparkSubmitFailed, training_failure
from airflow_provider_torchdist.outputs.signing import signing_key, status_view_key
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.submit.plan import SubmitPlan
from airflow_provider_torchdist.submit.properties import write_private_text
from airflow_provider_torchdist.submit.staging import StagedRun
from airflow_provider_torchdist.supervision.config import ERROR_FILE, LOCK_WAIT_FILE, LOG_FILE, PLAN_FILE
from airflow_provider_torchdist.supervision.launch import launch_supervisor
from airflow_provider_torchdist.supervision.lifeline import (
    AppEvent,
    DoneEvent,
    LifelineError,
    LineEvent,
    MetricEvent,
    OwnerConnection,
    RunGone,
    RunStatus,
    query_status,
)
from airflow_provider_torchdist.supervision.lifeline.retry import retry_unreachable
from airflow_provider_torchdist.supervision.lifeline_hosts import check_lifeline_address, lifeline_host
from airflow_provider_torchdist.supervision.lock import MAX_ENDING_S
from airflow_provider_torchdist.supervision.processes import end_session
from airflow_provider_torchdist.supervision.record import RunRecord, TaskBinding, owner_secret, status_secret
from airflow_provider_torchdist.supervision.sweep import ADDRESS_FILE, SUPERVISOR_FILE

#: How long the task waits for its supervisor to listen (it locks and binds; a new interpreter imports first).
START_TIMEOUT_S = 60.0
#: The states of a run a new owner can still take over; "gone" is a run whose supervisor is not there.
ACTIVE_STATES = ("starting", "running")
GONE = "gone"


def start_supervisor(
    staged: StagedRun,
    plan: SubmitPlan,
    *,
    durable: bool,
    reattach_timeout: float,
    bind_host: str = "127.0.0.1",
    checkpoint_dir: str | None = None,
    task: TaskBinding | None = None,
) -> RunRecord:
    """Hand the staged run to a detached supervisor; returns its record once it listens.

    ``task``: the task instance the run belongs to; only its owners can own the run (see
    :mod:`~airflow_provider_torchdist.supervision.record`).

    From here the supervisor owns the staging directory. When it cannot start, it is ended, the
    staging directory removed, and :class:`SparkSubmitFailed` says why (another live run of this
    task holding the checkpoint lock, for one).
    """
    run_id = staged.spec.run_id
    try:
        _hand_over(staged, plan, durable, reattach_timeout, bind_host, checkpoint_dir, task)
    except BaseException:  # a signing key that cannot be read, say: leave nothing behind
        staged.cleanup()
        raise
    emit("supervisor_start")
    process = launch_supervisor(staged.dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        address = _read_address(staged.dir / ADDRESS_FILE)
        if address is not None:
            emit("supervisor_listening")
            return RunRecord(
                run_id=run_id,
                host=address["host"],
                port=address["port"],
                durable=durable,
                reattach_timeout=float(reattach_timeout),
                task=task,
            )
        code = process.poll()
        deadline = max(deadline, _lock_wait_deadline(staged.dir))
        if code is not None or time.monotonic() > deadline:
            why = _start_failure(staged.dir, code)
            end_session(process.pid, grace=2.0)
            process.wait()
            staged.cleanup()
            raise SparkSubmitFailed(why)
        time.sleep(0.01)


def _hand_over(
    staged: StagedRun,
    plan: SubmitPlan,
    durable: bool,
    reattach_timeout: float,
    bind_host: str,
    checkpoint_dir: str | None,
    task: TaskBinding | None,
) -> None:
    """The supervisor's two private files in the staging directory: the plan, and its settings."""
    run_id = staged.spec.run_id
    key = signing_key()  # read once: its _CMD form runs a command
    write_private_text(staged.dir / PLAN_FILE, plan.to_json())
    write_private_text(
        staged.dir / SUPERVISOR_FILE,
        json.dumps(
            {
                "run_id": run_id,
                "durable": durable,
                "reattach_timeout": float(reattach_timeout),
                "bind_host": bind_host,
                "checkpoint_dir": checkpoint_dir,
                # Handed over in a private file: the supervisor does not read Airflow's config.
                "owner_secret_hex": owner_secret(run_id, key, task).hex(),
                # What the Training view may ask with: status queries only.
                "status_secret_hex": status_secret(run_id, status_view_key(key), task).hex(),
                "output_file": str(staged.output_path),  # every kind: a script's set_output()
                "stop_grace_period": float(staged.spec.stop_grace_period),
            }
        ),
    )


def _lock_wait_deadline(staging: Path) -> float:
    """How long to wait for a supervisor that waits for an earlier run's stop (``LOCK_WAIT_FILE``):
    until that run said it would be gone, then :data:`START_TIMEOUT_S` (monotonic; 0 when none)."""
    try:
        until = json.loads((staging / LOCK_WAIT_FILE).read_text())["until"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until):
        return 0.0
    # Capped as the lock caps it: an hour's grace and the hard end.
    left = min(until - time.time(), MAX_ENDING_S)
    return time.monotonic() + max(0.0, left) + START_TIMEOUT_S


def _read_address(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet: the supervisor renames it into place whole
    if not (isinstance(data, dict) and isinstance(data.get("host"), str) and type(data.get("port")) is int):
        return None
    return data


def _start_failure(staging: Path, code: int | None) -> str:
    try:
        error = (staging / ERROR_FILE).read_text().strip()
    except OSError:
        error = ""
    if not error:
        try:
            error = "\n".join((staging / LOG_FILE).read_text(errors="replace").splitlines()[-20:])
        except OSError:
            error = "(no output)"
    if code is None:
        return f"The run's supervisor did not start listening within {START_TIMEOUT_S:.0f} s: {error}"
    return f"The run's supervisor could not start the run (exit code {code}): {error}"


def connect_owner(record: RunRecord, *, kind: str = "task", since: int = 0) -> OwnerConnection:
    """Become the run's owner: a lifeline to its supervisor, authenticated both ways (tried again
    for a while when the supervisor is busy or does not answer: :func:`retry_unreachable`).
    :class:`~.lifeline_hosts.LifelineHostRefused` for a record naming a host outside the allow-list."""
    check_lifeline_address(record.host, record.port)
    secret = record.secret()
    return retry_unreachable(
        lambda: OwnerConnection(record.host, record.port, record.run_id, secret, kind=kind, since=since)
    )


def follow_to_end(
    owner: OwnerConnection,
    run_id: str,
    *,
    on_line: Callable[[str], None],
    on_application: Callable[[str, str | None, str | None], None],
    on_metric: Callable[[dict[str, Any]], None] = lambda record: None,
) -> RunStatus:
    """Read the run's events as its owner until it ends: its log lines to ``on_line``, its
    application to ``on_application``, each ``report()`` record to ``on_metric``; returns its final
    status. Raises :class:`SparkSubmitFailed` when the lifeline ends without one."""
    status = None
    for event in owner.events():
        if isinstance(event, LineEvent):
            on_line(event.text)
        elif isinstance(event, AppEvent):
            on_application(event.app_id, event.ui_url, event.operation)
        elif isinstance(event, MetricEvent):
            on_metric(event.record)
        elif isinstance(event, DoneEvent):
            status = event.status
    if status is None:
        raise SparkSubmitFailed(f"The lifeline of run {run_id} ended without the run's outcome.")
    return status


def run_state(record: RunRecord) -> str:
    """The run's state as its supervisor reports it, or ``"gone"`` when no supervisor answers.

    Raises :class:`LifelineError` when something answers at the address but cannot prove it is this
    run's supervisor (wrong credentials): that is never taken for a run to reattach to, nor is a
    record naming a host outside the allow-list (:class:`~.lifeline_hosts.LifelineHostRefused`).
    """
    check_lifeline_address(record.host, record.port)
    secret = record.secret()
    try:
        return retry_unreachable(lambda: query_status(record.host, record.port, record.run_id, secret)).state
    except RunGone:
        return GONE


def end_run(record: RunRecord, timeout: float = 30.0, why: str | None = None) -> None:
    """Stop a run this task no longer wants (a failed run kept for its owner), and wait until its
    supervisor stops answering (its ranks then have their grace period; a next run of the task
    waits for the checkpoint lock). ``why``: what the ranks are told ("timeout", "killed")."""
    try:
        with connect_owner(record) as owner:
            owner.stop(why)
    except RunGone:
        return
    deadline = time.monotonic() + timeout
    while run_state(record) != GONE:
        if time.monotonic() > deadline:
            raise SparkSubmitFailed(
                f"The earlier run {record.run_id} at {record.host}:{record.port} did not end within "
                f"{timeout:.0f} s of being stopped."
            )
        time.sleep(0.1)


def stop_abandoned(record: RunRecord, retry_coming: bool, log: Any) -> None:
    """The task fails while it owns ``record``'s run: with no retry to come back for it, stop the
    run now rather than leave it holding its application and lock for ``reattach_timeout``."""
    if retry_coming:
        return  # the retry reattaches (a durable run) or ends it and starts afresh
    try:
        end_run(record)
    except Exception as exc:  # the task's own error is the one to raise
        log.warning("Could not stop run %s: %s", record.run_id, exc)


def raise_for_failure(status: RunStatus) -> None:
    """Raise the error an in-process run would have raised for this ended run (nothing if it succeeded)."""
    if status.state == "succeeded":
        return
    if status.error_kind == "training" or status.failures:
        raise training_failure([RankFailure(**f) for f in status.failures], status.error)
    raise SparkSubmitFailed(status.error or f"The run ended in state {status.state!r} without an error.")


__all__ = [
    "ACTIVE_STATES",
    "GONE",
    "LifelineError",
    "RunGone",
    "connect_owner",
    "end_run",
    "follow_to_end",
    "lifeline_host",
    "raise_for_failure",
    "run_state",
    "start_supervisor",
    "stop_abandoned",
]
