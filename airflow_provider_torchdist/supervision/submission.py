"""What the run's supervisor runs, the verdict it reads when spark-submit ends, and how it ends it.

:class:`RunProcess` is spark-submit as the supervisor sees it (the plan's
:class:`~airflow_provider_torchdist.submit.spark_submit.Submission`, from :func:`submission_of`, or a test's
stand-in); :func:`run_verdict` turns what the driver left in the staging directory into the run's
end state, as ``hook.run()`` would judge it; :func:`end_process` stops spark-submit and every
process of its session at teardown. The Spark provider (and so Airflow) is imported only when the
real submission is made, never at the supervisor's start.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from airflow_provider_torchdist.supervision.config import PLAN_FILE, log

#: How the driver's own lines start; they come over the run channel (not forwarded twice).
DRIVER_PREFIX = "[torchdist] "
#: How long teardown waits for spark-submit's thread once its session is being ended.
KILL_WAIT_S = 30.0


class RunProcess(Protocol):
    """What the supervisor runs: :class:`~airflow_provider_torchdist.submit.spark_submit.Submission`, or a
    test's stand-in. ``run`` blocks until spark-submit ends (raising when it failed); ``kill`` may
    come from another thread; ``session`` is spark-submit's session id once known."""

    session: int | None

    def run(self) -> None: ...

    def kill(self) -> None: ...


def submission_of(
    staging_dir: Path, plan_text: str, on_line: Callable[[str], Any] | None = None
) -> RunProcess:
    """The real run: ``plan.json`` through ``SparkSubmitHook`` (imports the Spark provider).
    ``on_line``: where this process's log lines go besides its log file (:func:`forward_logs`)."""
    from airflow_provider_torchdist.submit.connect import submission_for
    from airflow_provider_torchdist.submit.plan import SubmitPlan

    data = json.loads(plan_text)
    fields = dataclasses.fields(SubmitPlan)
    names = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    if not required <= set(data) <= names:  # a plan of a release before an optional field is one
        raise ValueError(
            f"{PLAN_FILE} must hold {sorted(required)} (and may hold {sorted(names - required)}), got {sorted(data)}"
        )
    if on_line is not None:
        forward_logs(on_line)
    return submission_for(SubmitPlan.from_json(plan_text))


def forward_logs(on_line: Callable[[str], Any]) -> None:
    """Hand every log line of this process (``SparkSubmitHook``'s lines of spark-submit's output
    above all: a JVM's error before the driver starts, the cluster's answer) to ``on_line`` as well,
    escaped, so that the run's owners see in the task log what ``hook.run()`` shows there.

    Only for the supervisor's own process, once Airflow's logging is configured (the Spark provider
    is imported): one processor added, before the renderer, through structlog's public configure.
    """
    import structlog

    from airflow_provider_torchdist.spark.wire.logsafe import escape_controls

    def to_owners(logger: Any, method_name: str, event_dict: Any) -> Any:
        event = event_dict.get("event") if isinstance(event_dict, dict) else None
        # The driver's own "[torchdist] ..." lines reach the owners over the run channel already.
        if event is not None and not str(event).startswith(DRIVER_PREFIX):
            on_line(escape_controls(str(event)))
        return event_dict

    processors = list(structlog.get_config()["processors"])
    structlog.configure(processors=[*processors[:-1], to_owners, *processors[-1:]])


def run_verdict(
    staging_dir: Path, output_file: Path | None, submit_error: BaseException | None
) -> tuple[str, dict[str, Any]]:
    """spark-submit has ended: the run's end state and its details (for ``RunState.finish``), as
    ``hook.run()`` would judge it. ``output_file`` is rank 0's output file (None: no output expected)."""
    from airflow_provider_torchdist.spark.wire.outcome import OUTCOME_FILE, Outcome
    from airflow_provider_torchdist.spark.wire.output_store import OutputManifest

    try:
        outcome = Outcome.read(staging_dir)
    except (OSError, ValueError, TypeError) as exc:
        outcome, submit_error = None, submit_error or exc
    if outcome is None:
        error = f"The Spark application ended before the training driver reported an outcome: {submit_error}"
        if (staging_dir / OUTCOME_FILE).with_suffix(".tmp").exists():
            error = (
                f"The training driver could not write its outcome into the staging directory {staging_dir} "
                f"(is its disk full?): {submit_error}"
            )
        return "failed", {"error": error, "metrics": []}
    # What every verdict carries from the outcome, succeeded or failed.
    seen = {"metrics": outcome.metrics, "world_sizes": outcome.world_sizes}
    if not outcome.ok:
        failures = [dataclasses.asdict(f) for f in outcome.failures]
        return "failed", {"error": outcome.error, "error_kind": "training", "failures": failures, **seen}
    if output_file is None:
        return "succeeded", seen
    manifest = OutputManifest.read(output_file)
    if manifest is None:
        error = (
            f"Training succeeded but rank 0's output at {output_file} has no valid manifest from the driver; it is not used."
            if output_file.exists()
            else "Training succeeded but rank 0's return value never reached the driver."
        )
        return "failed", {"error": error, **seen}
    output = {
        "format": manifest.format,
        "type": manifest.type,
        "size": manifest.size,
        "sha256": manifest.sha256,
    }
    return "succeeded", {**seen, "output": output, "output_path": output_file}


def outcome_is_out(staging_dir: Path) -> bool:
    """Whether the driver has written its outcome (see :func:`verdict_when_out`)."""
    from airflow_provider_torchdist.spark.wire.outcome import OUTCOME_FILE

    return (staging_dir / OUTCOME_FILE).exists()


def verdict_when_out(staging_dir: Path, output_file: Path | None) -> tuple[str, dict[str, Any]] | None:
    """A succeeded run's verdict once the driver's outcome is out, spark-submit still running or
    not; None before, and for any other verdict (spark-submit's end decides those, as before).

    The driver writes it (atomically) once every rank has ended and before its SparkContext stops,
    and :func:`run_verdict` judges by it alone whatever spark-submit's end: Spark's own stop,
    the driver's and the JVM's exits (0.5 s of a launch) need not keep the run's owner waiting.
    A failed run waits for them: its cancelled ranks may still be going (a retry must not start
    beside them), and an output whose manifest is not in yet is no verdict."""
    if not outcome_is_out(staging_dir):
        return None
    try:
        state, details = run_verdict(staging_dir, output_file, None)
    except (OSError, ValueError, TypeError):
        return None
    return (state, details) if state == "succeeded" else None


def failure_summary(failure: dict[str, Any]) -> str:
    """One failed rank (as the run's status holds it) in a line of the supervisor's log."""
    from airflow_provider_torchdist.spark.wire.outcome import RankFailure

    try:
        return RankFailure(**failure).summary()
    except TypeError:
        return str(failure)


def end_process(process: RunProcess, run_thread: threading.Thread) -> None:
    """Stop spark-submit (``run_thread`` runs it) and end every process of its session."""
    from airflow_provider_torchdist.supervision.processes import end_session

    if run_thread.is_alive():  # still running: stop it (and a cluster-side application)
        try:
            process.kill()
        except Exception as exc:  # a failing cluster-side kill must not keep local processes alive
            log(f"spark-submit's kill failed: {exc!r}")
    deadline = time.monotonic() + KILL_WAIT_S
    # spark-submit may only just be starting: end its session until its thread has returned.
    while run_thread.is_alive() and time.monotonic() < deadline:
        if process.session is not None:
            end_session(process.session, grace=5.0)
        run_thread.join(0.05)
    if process.session is not None:
        left = end_session(process.session, grace=5.0)
        if left:
            log(f"processes of spark-submit's session {process.session} still alive: {left}")
    if run_thread.is_alive():
        log(f"spark-submit's thread did not return within {KILL_WAIT_S:g} s")
