"""The run's supervisor: ``python -m airflow_provider_torchdist.supervision.supervisor <staging_dir>``.

The task stages a run and starts this process detached (own session, stdin /dev/null, no inherited
descriptors: :func:`~airflow_provider_torchdist.supervision.processes.start_detached`), so the run no longer
lives and dies with the task. It reads ``<staging>/supervisor.json`` (0600)::

    {"run_id", "durable", "reattach_timeout", "bind_host", "checkpoint_dir", "owner_secret_hex",
     "output_file"}

and ``<staging>/plan.json`` (``SubmitPlan.to_json()``), then:

1. takes ``<checkpoint_dir>/.torchdist-run.lock`` (``flock``, for its whole life): a second live run
   of the same task fails at once (``supervisor.error``, exit code 3);
2. sweeps what dead runs left in the temp directory (:mod:`~airflow_provider_torchdist.supervision.sweep`), in
   the background;
3. listens for owners (:mod:`~airflow_provider_torchdist.supervision.lifeline`) and writes
   ``<staging>/supervisor.addr`` = ``{"host", "port", "pid"}`` (atomic, 0600);
4. runs spark-submit (:class:`~airflow_provider_torchdist.submit.spark_submit.Submission`) and follows the
   driver (:class:`~airflow_provider_torchdist.submit.follow.RunFollower`), keeping the last log
   lines, the application and the metrics for its owners;
5. when spark-submit ends, reads the outcome and keeps rank 0's output until an owner releases it.

**Owners.** At most one at a time: a new authenticated owner replaces the old one. An owner is
lost when its connection closes, or it is silent for ``OWNER_SILENCE_S``, without ``detach`` or
``release`` first. A run still training that loses a ``task`` owner and is not ``durable`` is torn
down at once; otherwise (a durable run, a trigger, a ``detach``, a run that has ended) the
supervisor waits ``reattach_timeout`` for the next owner, then tears down. ``stop`` tears down now;
``release`` tears an ended run down. Before its first owner, a run waits as after a loss (the task
connects right after the address appears).

**Teardown** (:meth:`RunSupervisor.teardown`, also on SIGTERM and SIGINT): stop spark-submit, end
every process of its session, stop following, close the lifeline, remove the staging directory,
release the lock, exit 0.

Start failures (before the address is written) go to ``<staging>/supervisor.error``, exit code 2.

This module is the process (:func:`main`); the pieces it runs live beside it and are re-exported
here: the settings, files and start errors (:mod:`~airflow_provider_torchdist.supervision.config`),
the lock (:mod:`~airflow_provider_torchdist.supervision.lock`), :class:`RunSupervisor`
(:mod:`~airflow_provider_torchdist.supervision.run_supervisor`) with its owner rules
(:mod:`~airflow_provider_torchdist.supervision.owners`), and what it runs and how it reads the verdict
(:mod:`~airflow_provider_torchdist.supervision.submission`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from airflow_provider_torchdist.spark.node.checkpoint_store import local_path
from airflow_provider_torchdist.spark.wire.private_files import write_private_text
from airflow_provider_torchdist.supervision.config import (
    ERROR_FILE,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_START_FAILED,
    LOCK_FILE,
    LOCK_WAIT_FILE,
    LOG_FILE,
    PLAN_FILE,
    RunLocked,
    SupervisorConfig,
    SupervisorStartError,
    log,
    read_plan_text,
    read_private,
)
from airflow_provider_torchdist.supervision.lock import RunLock
from airflow_provider_torchdist.supervision.owners import STOPPED_BY_OWNER
from airflow_provider_torchdist.supervision.run_supervisor import RunSupervisor
from airflow_provider_torchdist.supervision.submission import KILL_WAIT_S, RunProcess, submission_of
from airflow_provider_torchdist.supervision.sweep import ADDRESS_FILE, SUPERVISOR_FILE, sweep_stale

__all__ = [
    "ADDRESS_FILE",
    "ERROR_FILE",
    "EXIT_LOCKED",
    "EXIT_OK",
    "EXIT_START_FAILED",
    "KILL_WAIT_S",
    "LOCK_FILE",
    "LOG_FILE",
    "PLAN_FILE",
    "STOPPED_BY_OWNER",
    "SUPERVISOR_FILE",
    "RunLock",
    "RunLocked",
    "RunProcess",
    "RunSupervisor",
    "SupervisorConfig",
    "SupervisorStartError",
    "main",
    "read_plan_text",
    "read_private",
    "submission_of",
]


# -- the process ----------------------------------------------------------------------------------


def write_start_error(staging_dir: Path, text: str) -> None:
    log(f"cannot start: {text}")
    with contextlib.suppress(OSError):
        write_private_text(staging_dir / ERROR_FILE, text + "\n")


def _say_lock_wait(staging_dir: Path, until: float) -> None:
    """The earlier run of this task is still stopping: say until when, for the task (``LOCK_WAIT_FILE``)."""
    log(f"waiting for the earlier run of this task to finish stopping (until {until:.0f})")
    with contextlib.suppress(OSError):
        write_private_text(staging_dir / LOCK_WAIT_FILE, json.dumps({"until": until}))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m airflow_provider_torchdist.supervision.supervisor <staging_dir>",
            file=sys.stderr,
        )
        return EXIT_START_FAILED
    staging = Path(args[0])
    lock: RunLock | None = None
    try:
        config = SupervisorConfig.read(staging)
        plan_text = read_plan_text(staging)
        # A lock file needs a local directory; a remote store (s3://...) has no flock: see
        # docs/checkpoints.md (two live runs of one task there are kept apart by the run record).
        if config.checkpoint_dir and local_path(config.checkpoint_dir) is not None:
            lock = RunLock.acquire(
                config.checkpoint_dir, on_wait=lambda until: _say_lock_wait(staging, until)
            )
        supervisor = RunSupervisor(staging, config, plan_text=plan_text, lock=lock)
        supervisor.listen()
    except SupervisorStartError as exc:
        if lock is not None:
            lock.release()
        write_start_error(staging, str(exc))
        return exc.exit_code
    except Exception as exc:  # a port that cannot be bound, a host that does not resolve, ...
        if lock is not None:
            lock.release()
        write_start_error(staging, f"{type(exc).__name__}: {exc}")
        return EXIT_START_FAILED
    threading.Thread(target=_sweep, args=(staging,), name="torchdist-sweep", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The handler only hands over to a thread: the main thread may hold the supervisor's lock.
        signal.signal(
            sig,
            lambda signum, _frame: threading.Thread(
                target=supervisor.request_teardown,
                args=(f"the supervisor got {signal.Signals(signum).name}",),
            ).start(),
        )
    return supervisor.serve()


def _sweep(staging: Path) -> None:
    started = time.monotonic()
    try:
        removed = sweep_stale([Path(tempfile.gettempdir()), staging.parent])
    except Exception as exc:  # never worth failing a run for
        log(f"sweeping stale run directories failed: {exc!r}")
        return
    if removed:
        log(
            f"swept {len(removed)} stale run directories in {time.monotonic() - started:.3f} s: {', '.join(map(str, removed))}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
