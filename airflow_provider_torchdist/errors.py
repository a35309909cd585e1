"""Errors the provider raises on the Airflow side. Each says what happened and what to do."""

from __future__ import annotations

from airflow.providers.common.compat.sdk import AirflowException

from airflow_provider_torchdist.spark.wire.outcome import HUNG_ERROR_PREFIX, RankFailure


class TorchDistributorError(AirflowException):
    """Base class of this provider's errors."""


class InvalidTrainingConfig(TorchDistributorError, ValueError):
    """An argument of the operator or hook is wrong; raised before anything runs."""


class UnknownArgument(InvalidTrainingConfig, TypeError):
    """An argument that the operator, the hook or ``spark_submit_kwargs`` does not take (a typo);
    a ``TypeError`` too, as Python's own "unexpected keyword argument" is."""


class PayloadNotPicklable(TorchDistributorError, TypeError):
    """The callable or one of its arguments cannot be pickled; raised before spark-submit."""


class SparkSubmitFailed(TorchDistributorError):
    """The Spark application failed before any rank could report (submit, cluster or driver error)."""


class TrackingUnavailable(TorchDistributorError):
    """The MLflow tracking server of ``mlflow_conn_id`` did not answer or refused the credentials at
    task start; raised before spark-submit (docs/tracking.md)."""


class TrainingFailed(TorchDistributorError):
    """One or more ranks failed. ``failures`` holds each one's rank, host, exit code and exception."""

    def __init__(self, failures: list[RankFailure], error: str | None = None) -> None:
        self.failures = failures
        self.error = error
        # A failure no rank owns (Spark lost an executor, say) is the root cause: it goes first.
        lines = [error] if error else []
        lines += [f.summary() for f in failures]
        lines = lines or ["training failed"]
        first = next((f for f in failures if f.traceback), None)
        text = "Distributed training failed: " + "; ".join(lines)
        if first is not None:
            text += f"\n\nTraceback from rank {first.rank} on {first.host}:\n{first.traceback.rstrip()}"
        super().__init__(text)

    @property
    def failed_ranks(self) -> list[int]:
        return [f.rank for f in self.failures if f.rank is not None]


class TrainingHung(TrainingFailed):
    """The run made no progress for ``hang_timeout`` seconds and was stopped (see docs/hangs.md).

    The message names the ranks without progress, the suspects (ranks not in a collective while
    the others wait in one, or silent ones) with their host and the user code line where each
    sits; every rank's stacks are in the task log. A retry resumes from the last checkpoint.
    ``failures`` holds how the ranks ended when the stopped run was ended (killed, mostly): not
    in the message, which is the hang's.
    """

    def __init__(self, failures: list[RankFailure], error: str | None = None) -> None:
        super().__init__([], error)
        self.failures = failures


def training_failure(failures: list[RankFailure], error: str | None) -> TrainingFailed:
    """The error of a run whose ranks failed: :class:`TrainingHung` when the driver found it hung."""
    if error is not None and error.startswith(HUNG_ERROR_PREFIX):
        return TrainingHung(failures, error)
    return TrainingFailed(failures, error)
