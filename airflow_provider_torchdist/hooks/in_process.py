"""The hook's in-process run (``hook.run()``): spark-submit as a child of this process.

:func:`submit_and_follow` runs the plan's :class:`~airflow_provider_torchdist.submit.spark_submit.Submission`
while a :class:`~airflow_provider_torchdist.submit.follow.RunFollower` follows the driver (its log
lines and application), then reads the driver's outcome; :func:`raise_for_outcome` raises what the
run ended with; :func:`end_submission` ends what is left of spark-submit's session. A supervised
run is :mod:`~airflow_provider_torchdist.supervision.task_side`'s instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow.providers.common.compat.sdk import AirflowException

from airflow_provider_torchdist.errors import SparkSubmitFailed, training_failure
from airflow_provider_torchdist.spark.driver.owner import write_owner_token
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.outcome import Outcome
from airflow_provider_torchdist.submit.follow import RunFollower
from airflow_provider_torchdist.submit.spark_submit import Submission
from airflow_provider_torchdist.submit.staging import StagedRun
from airflow_provider_torchdist.supervision.processes import end_session


def submit_and_follow(
    submission: Submission,
    staged: StagedRun,
    *,
    on_line: Callable[[str], None],
    on_application: Callable[[str, str | None, str | None], None],
    on_metric: Callable[[dict[str, Any]], None] = lambda record: None,
) -> tuple[Outcome | None, AirflowException | None]:
    """Run spark-submit to its end, following the driver (its lines, application and each
    ``report()`` record, from the follower's thread); returns the driver's outcome (None when it
    reported none, else with the complete metric history) and spark-submit's error (None when it
    succeeded)."""
    submit_error: AirflowException | None = None
    follower = RunFollower(
        staged.dir,
        write_owner_token(staged.dir),
        on_line=on_line,
        on_application=on_application,
        on_metric=on_metric,
    )
    follower.start()
    try:
        submission.run()
    except AirflowException as exc:
        submit_error = exc
    finally:
        follower.stop()
    outcome = Outcome.read(staged.dir)
    emit("outcome_read")
    return outcome, submit_error


def raise_for_outcome(
    outcome: Outcome | None, submit_error: AirflowException | None, staged: StagedRun
) -> None:
    """Raise what the run ended with: :class:`SparkSubmitFailed` when the driver reported no
    outcome or rank 0's value never reached it, :class:`TrainingFailed` naming the failed ranks
    (:class:`TrainingHung` when the driver found the run hung)."""
    if outcome is None:
        raise SparkSubmitFailed(
            f"The Spark application ended before the training driver reported an outcome: {submit_error}"
        ) from submit_error
    if not outcome.ok:
        raise training_failure(outcome.failures, outcome.error)
    if not staged.output_path.exists():  # a script's rank 0 sends one too (set_output, or None)
        raise SparkSubmitFailed("Training succeeded but rank 0's return value never reached the driver.")


def end_submission(submission: Submission | None, grace: float = 5.0) -> None:
    """End whatever is left of spark-submit's session: JVM, Python driver, Spark's Python daemon
    and workers (which move to process groups of their own, but stay in the session), local ranks."""
    if submission is not None and submission.session is not None:
        end_session(submission.session, grace)
    emit("session_ended")
