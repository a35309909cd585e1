"""The end of a driver's run: its outcome written for the run's owner, and said, once."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from airflow_provider_torchdist.spark.wire.outcome import Outcome

#: The exit code of each run whose outcome is out (:func:`finish` runs once per run).
_FINISHED: dict[Path, int] = {}


def finish(outcome: Outcome, staging: Path) -> int:
    """Write the outcome for the hook, say it, and return the exit code; once per run (a second
    call returns the first one's code).

    A run on a cluster finishes while its SparkContext is still up, so that its outcome stays
    whatever stopping Spark then does (``app.main`` keeps it if the stop fails)."""
    if staging in _FINISHED:
        return _FINISHED[staging]
    _FINISHED[staging] = code = _write_and_say(outcome, staging)
    return code


def _write_and_say(outcome: Outcome, staging: Path) -> int:
    try:
        outcome.write(staging)
    except OSError as exc:  # a full staging disk: say it where the task log shows it
        print(f"[torchdist] the run's outcome could not be written to {staging}: {exc}", flush=True)
        return 1
    if outcome.ok:
        print("[torchdist] training finished on all ranks", flush=True)
        return 0
    for failure in outcome.failures:
        print(f"[torchdist] {failure.summary()}", flush=True)
    if outcome.error:
        print(f"[torchdist] {outcome.error}", flush=True)
    return 1


def finished_code(staging: Path) -> int | None:
    """The exit code of the run in ``staging`` once its outcome is out; None before."""
    return _FINISHED.get(staging)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with ``code`` at once: log handlers and the standard streams flushed, then
    ``os._exit``, skipping the interpreter's teardown.

    For the local-mode driver, whose process has torch loaded (torchrun's agent ran here): tearing
    that interpreter down takes about 0.4 s (0.02 s this way, ``bench/profile_launch.py``), and
    spark-submit, so the run's owner, waits for it. Nothing of the run needs it by then: the
    outcome is written and closed, the ranks reaped, the agent's directories removed, and no
    SparkContext is up (a local run that read ``train_data`` stopped its own). Airflow's task
    processes and multiprocessing's children end the same way."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)
