"""TorchDistributorHook: a spec in, rank 0's value out; spark-submit through the Spark provider's hook.

The hook plans and submits. It resolves the connection (:mod:`~airflow_provider_torchdist.submit.connection`),
runs the checks that can fail before anything starts (:mod:`~airflow_provider_torchdist.submit.preflight`),
stages the work (:mod:`~airflow_provider_torchdist.submit.staging`), turns all of it into a plain
:class:`~airflow_provider_torchdist.submit.plan.SubmitPlan`, and runs that through
``SparkSubmitHook``'s public constructor and ``submit()``.

Its pieces live beside it: its arguments (:mod:`~airflow_provider_torchdist.hooks.arguments`), the
checks, staging and plan (:mod:`~airflow_provider_torchdist.submit.prepare`), the in-process run
(:mod:`~airflow_provider_torchdist.hooks.in_process`) and the supervised one, the operator's
(:mod:`~airflow_provider_torchdist.hooks.supervised`, over
:mod:`~airflow_provider_torchdist.supervision.task_side`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from airflow.providers.common.compat.sdk import BaseHook

from airflow_provider_torchdist.hooks.arguments import HOOK_SETTINGS, hook_signature, spec_from_arguments
from airflow_provider_torchdist.hooks.in_process import end_submission, raise_for_outcome, submit_and_follow
from airflow_provider_torchdist.hooks.supervised import SupervisedRunsMixin
from airflow_provider_torchdist.links import ApplicationLinks
from airflow_provider_torchdist.spark.driver.stragglers import is_rank_summary, split_summaries
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.output_store import read_output
from airflow_provider_torchdist.spec import (
    DEFAULT_CONN_ID,
    TrainingSpec,
    documented,
)
from airflow_provider_torchdist.submit.connect import (
    ConnectSubmission,
    submission_for,
)
from airflow_provider_torchdist.submit.connection import CONN_TYPE, SparkTarget, resolve_target
from airflow_provider_torchdist.submit.masking import mask_setting_secrets
from airflow_provider_torchdist.submit.plan import SubmitPlan
from airflow_provider_torchdist.submit.prepare import check_and_stage, plan_staged
from airflow_provider_torchdist.submit.spark_submit import Submission
from airflow_provider_torchdist.submit.staging import StagedRun
from airflow_provider_torchdist.submit.validation import check_deploy_mode
from airflow_provider_torchdist.supervision.lifeline import LifelineError, OwnerConnection, RunStatus
from airflow_provider_torchdist.supervision.record import RunRecord
from airflow_provider_torchdist.supervision.task_side import (
    end_run,
)

T = TypeVar("T")


@documented([n for n in HOOK_SETTINGS if n != "spark_submit_kwargs"])
class TorchDistributorHook(SupervisedRunsMixin, BaseHook):
    """Run a PyTorch training callable or script on Spark and return rank 0's value.

    Semantics follow PySpark's ``TorchDistributor``. A callable runs as ``fn(*args, **kwargs)`` on
    every rank; a script path runs like ``torchrun script.py *args``. With no Spark connection
    configured, the run goes to an embedded ``local[N]`` master on this machine. Every setting of
    :class:`~airflow_provider_torchdist.spec.TrainingSpec` is a keyword argument; any other keyword
    is a ``SparkSubmitHook`` argument (``executor_memory``, ``driver_memory``, ``name``, ...). Or
    pass a ready ``spec=`` (:func:`~airflow_provider_torchdist.submit.checks.build_spec`).

    :param spec: a ready, validated spec instead of the settings as keywords.

    Example::

        hook = TorchDistributorHook(num_processes=2, local_mode=False, use_gpu=False)
        result = hook.run(train_fn, 1e-3, epochs=3)   # rank 0's return value
    """

    hook_name = "PyTorch on Spark"
    conn_type = CONN_TYPE
    conn_name_attr = "conn_id"
    default_conn_name = DEFAULT_CONN_ID

    def __init__(
        self,
        num_processes: int | str = 1,
        local_mode: bool = False,
        use_gpu: bool = False,
        *,
        spec: TrainingSpec | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if spec is None:
            spec = spec_from_arguments(num_processes, local_mode, use_gpu, settings)
        self.spec = spec
        # Airflow then redacts them from every log line and error.
        for values in (spec.conf, spec.rank_env, spec.env_vars):
            mask_setting_secrets(values)
        self.target: SparkTarget = resolve_target(spec, self.log)
        check_deploy_mode(self.target.deploy_mode)
        #: Called with the application's links as soon as the driver reports its id; the operator
        #: pushes them to XCom for the extra links.
        self.on_application: Callable[[ApplicationLinks], None] | None = None
        self.application_id: str | None = None
        #: Called once with a Spark Connect run's operation (``<session id>/<operation id>``) when
        #: its job runs; the operator adds it to the run's record.
        self.on_operation: Callable[[str], None] | None = None
        #: What the last run's training code reported with ``report()``, in order; it grows while
        #: the run trains.
        self.metrics: list[dict[str, Any]] = []
        #: Called with ``metrics`` each time it grows while the run trains (from the thread that
        #: follows the run); the operator pushes it to XCom, throttled.
        self.on_metrics: Callable[[list[dict[str, Any]]], None] | None = None
        #: How the last run's world size went, once it has ended: ``{"time": epoch seconds,
        #: "world_size": n, "reason": why}``, one entry at the start and one per change (an elastic
        #: run's losses and joins); empty before a run ends.
        self.world_sizes: list[dict[str, Any]] = []
        #: Each rank's mean step time and compute share (``{"rank", "time", "mean_step_time_s",
        #: "compute_share"}``), which the run adds at its end when the hang watchdog is on.
        self.rank_step_times: list[dict[str, Any]] = []
        #: The supervised run's final status, once :meth:`follow` has seen it end.
        self.run_status: RunStatus | None = None
        self.plan: SubmitPlan | None = None
        #: The last run's spark-submit (its ``session`` is spark-submit's session id, once started).
        self.submission: Submission | ConnectSubmission | None = None
        #: The run under way: its private staging directory and job spec.
        self.staged: StagedRun | None = None
        #: The supervised run this hook started or follows, and its lifeline while it owns it.
        self.record: RunRecord | None = None
        self._owner: OwnerConnection | None = None

    __init__.__signature__ = hook_signature()  # type: ignore[attr-defined]

    @property
    def embedded(self) -> bool:
        """True when the run goes to the embedded ``local[N]`` master on this machine."""
        return self.target.embedded

    # -- running ------------------------------------------------------------------------------

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Train, and return global rank 0's return value (a script's: what its rank 0 passed to
        ``set_output``, else None).

        This library path decodes rank 0's value here, unpickling it when it is not JSON: its
        caller is the one who ran the training, on this machine, so nothing in between could have
        changed it. The operator never unpickles; it signs the bytes for XCom
        (:func:`~airflow_provider_torchdist.outputs.results.output_to_xcom`).

        Raises :class:`TrainingFailed` naming each failed rank, its host and its exception.
        """
        return self.run_to_path(train_object, list(args), kwargs, read_output)

    def run_to_path(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
        handle: Callable[[Path | None], T],
    ) -> T:
        """Train, then hand ``handle`` the file holding rank 0's encoded value
        before the staging directory goes: large outputs are streamed on, never loaded whole."""
        staged = self._prepare(train_object, args, kwargs)
        try:
            self._submit(self.plan, staged)
            return handle(staged.output_path)  # a script's too: what it set_output() (or None)
        finally:
            self._stop_session()
            staged.cleanup()
            self.staged = None

    def _prepare(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
    ) -> StagedRun:
        """Every check that can fail before anything starts, then the staged work and its plan
        (``self.staged``, ``self.plan``); the caller owns the staging directory from here."""
        emit("hook_start")
        staged, props, env = check_and_stage(self.spec, self.target, self.log, train_object, args, kwargs)
        self.staged = staged
        emit("staged")
        try:
            self.plan = plan_staged(self.spec, self.target, staged, props, env)
        except BaseException:
            staged.cleanup()
            self.staged = None
            raise
        return staged

    def _submit(self, plan: SubmitPlan, staged: StagedRun) -> None:
        self.submission = submission_for(plan)
        self.metrics, self.world_sizes, self.rank_step_times = [], [], []
        outcome, submit_error = submit_and_follow(
            self.submission,
            staged,
            on_line=self.log.info,
            on_application=self._application_started,
            on_metric=self._metric_reported,
        )
        if outcome is not None:  # the complete history (without one, what was followed live)
            self.metrics, self.rank_step_times = split_summaries(outcome.metrics)
            self.world_sizes = outcome.world_sizes
        raise_for_outcome(outcome, submit_error, staged)

    def _application_started(self, app_id: str, ui_url: str | None, operation: str | None = None) -> None:
        """The driver's SparkContext is up (over Connect: the run's job runs): note it, and tell the
        operator (the extra links, and the Connect operation for the run's record)."""
        if self.application_id is not None:
            return
        self.application_id = app_id
        if self.on_application:
            self.on_application(
                ApplicationLinks.of(
                    app_id,
                    ui_url,
                    master_web_ui=self.target.master_web_ui,
                    history_server=self.target.history_server,
                )
            )
        if operation and self.on_operation:
            self.on_operation(operation)

    def _metric_reported(self, record: dict[str, Any]) -> None:
        if is_rank_summary(record):  # a rank's step time, at the end: not a report
            self.rank_step_times.append(record)
            return
        self.metrics.append(record)
        if self.on_metrics:
            self.on_metrics(self.metrics)

    # -- stopping -----------------------------------------------------------------------------

    def _stop_session(self, grace: float = 5.0) -> None:
        """End whatever is left of spark-submit's session (:func:`end_submission`)."""
        end_submission(self.submission, grace)

    def on_kill(self) -> None:
        """Stop the Spark application and every process of the run (Airflow's kill or timeout).

        A supervised run is told "stop" over its lifeline, durable or not: an explicit kill is
        never taken for a lost owner."""
        owner = self._owner
        if owner is not None:
            with contextlib.suppress(LifelineError, OSError):
                owner.stop("killed")
        elif self.record is not None:
            with contextlib.suppress(LifelineError, OSError):
                end_run(self.record, timeout=4.0, why="killed")
        if self.submission is not None:
            self.submission.kill()
        self._stop_session()
        if self.staged is not None:
            self.staged.cleanup()
