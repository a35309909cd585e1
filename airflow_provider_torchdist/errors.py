"""Errors the provider raises on the Airflow side. Each says what happened and what to do."""

from __future__ import annotations

from airflow.providers.common.compat.sdk import AirflowException

from airflow_provider_torchdist.spark.wire.outcome import RankFailure


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
