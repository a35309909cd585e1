"""TorchDistributorHook: a spec in, rank 0's value out; spark-submit through the Spark provider's hook.

The hook plans and submits. It resolves the connection (:mod:`~airflow_provider_torchdist.submit.connection`),
runs the checks that can fail before anything starts (:mod:`~airflow_provider_torchdist.submit.preflight`),
stages the work (:mod:`~airflow_provider_torchdist.submit.staging`), turns all of it into a plain
:class:`~airflow_provider_torchdist.submit.plan.SubmitPlan`, and runs that through
``SparkSubmitHook``'s public constructor and ``submit()``.

Its pieces live beside it: its arguments (:mod:`~airflow_provider_torchdist.hooks.arguments`), the
checks, staging and plan (:mod:`~airflow_provider_torchdist.submit.prepare`), the in-process run
(:mod:`~airflow_provider_torchdist.hooks.in_process`) and the supervised one
(:mod:`~airflow_provider_torchdist.supervision.task_side`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from airflow.providers.common.compat.sdk import BaseHook

from airflow_provider_torchdist.errors import SparkSubmitFailed
from airflow_provider_torchdist.hooks.arguments import HOOK_SETTINGS, hook_signature, spec_from_arguments
from airflow_provider_torchdist.hooks.in_process import end_submission, raise_for_outcome, submit_and_follow
from airflow_provider_torchdist.links import ApplicationLinks
from airflow_provider_torchdist.spark.connect.driver import planned_session_id
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.output_store import read_output
from airflow_provider_torchdist.spec import (
    DEFAULT_CONN_ID,
    DEFAULT_REATTACH_TIMEOUT,
    TrainingSpec,
    documented,
)
from airflow_provider_torchdist.submit.connect import (
    ConnectSubmission,
    interrupt_lost_run,
    submission_for,
)
from airflow_provider_torchdist.submit.connection import CONN_TYPE, SparkTarget, resolve_target
from airflow_provider_torchdist.submit.fast_start import FastStart
from airflow_provider_torchdist.submit.masking import mask_setting_secrets
from airflow_provider_torchdist.submit.plan import SubmitPlan
from airflow_provider_torchdist.submit.prepare import check_and_stage, plan_staged
from airflow_provider_torchdist.submit.spark_submit import Submission
from airflow_provider_torchdist.submit.staging import StagedRun
from airflow_provider_torchdist.submit.validation import check_deploy_mode
from airflow_provider_torchdist.supervision.lifeline import LifelineError, OwnerConnection, RunStatus
from airflow_provider_torchdist.supervision.record import RunRecord
from airflow_provider_torchdist.supervision.task_side import (
    connect_owner,
    end_run,
    follow_to_end,
    lifeline_host,
    raise_for_failure,
    start_supervisor,
)

T = TypeVar("T")


@documented([n for n in HOOK_SETTINGS if n != "spark_submit_kwargs"])
class TorchDistributorHook(BaseHook):
    """Run a PyTorch training callable or script on Spark and return rank 0's value.

    Semantics follow PySpark's ``TorchDistributor``. A callable runs as ``fn(*args, **kwargs)`` on
    every rank; a script path runs like ``torchrun script.py *args``. With no Spark connection
    configured, the run goes to an embedded ``local[N]`` master on this machine. Every setting of
    :class:`~airflow_provider_torchdist.spec.TrainingSpec` is a keyword argument; any other keyword
    is a ``SparkSubmitHook`` argument (``executor_memory``, ``driver_memory``, ``name``, ...). Or
    pass a ready ``spec=`` (:func:`~airflow_provider_torchdist.submit.checks.build_spec`).

    :param spec: a ready, validated spec instead of the settings as keywords.
    :param settings: the settings as keywords, and any other keyword: a ``SparkSubmitHook`` argument.

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
        self._fast: FastStart | None = None

    __init__.__signature__ = hook_signature()  # type: ignore[attr-defined]

    @property
    def embedded(self) -> bool:
        """True when the run goes to the embedded ``local[N]`` master on this machine."""
        return self.target.embedded

    # -- running ------------------------------------------------------------------------------

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Train, and return global rank 0's return value (None for a script).

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
        """Train, then hand ``handle`` the file holding rank 0's encoded value (None for a script)
        before the staging directory goes: large outputs are streamed on, never loaded whole."""
        staged, fast = self._prepare(train_object, args, kwargs)
        try:
            try:
                self._submit(self.plan, staged)
            finally:
                fast.finish()
            return handle(staged.output_path if staged.spec.kind == "callable" else None)
        finally:
            self._stop_session()
            staged.cleanup()
            self.staged = None

    def _prepare(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
    ) -> tuple[StagedRun, FastStart]:
        """Every check that can fail before anything starts, then the staged work and its plan
        (``self.staged``, ``self.plan``); the caller owns the staging directory from here."""
        emit("hook_start")
        staged, props, env = check_and_stage(self.spec, self.target, self.log, train_object, args, kwargs)
        self.staged = staged
        emit("staged")
        try:
            fast, self.plan = plan_staged(self.spec, self.target, staged, props, env)
        except BaseException:
            staged.cleanup()
            self.staged = None
            raise
        return staged, fast

    # -- supervised runs: the operator's path --------------------------------------------------

    def start_run(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        durable: bool = True,
        reattach_timeout: float = DEFAULT_REATTACH_TIMEOUT,
    ) -> RunRecord:
        """Stage and plan the run, and hand it to a detached supervisor; returns the run's record.

        The run no longer lives and dies with this process: :meth:`follow` owns it (this hook is
        connected as its owner already), and a retry or a trigger can own it later from the
        record. Without an owner, a ``durable=False`` run ends within 15 s; a durable one waits
        ``reattach_timeout`` seconds for the next (see :mod:`~airflow_provider_torchdist.supervision.task_side`).
        """
        staged, self._fast = self._prepare(train_object, args, kwargs)
        assert self.plan is not None
        record = start_supervisor(
            staged,
            self.plan,
            durable=durable,
            reattach_timeout=reattach_timeout,
            bind_host=lifeline_host(),
            checkpoint_dir=self.spec.checkpoint_dir,
        )
        self.staged = None  # the supervisor's now: it removes it when the run ends
        if self.target.is_connect and (session_id := planned_session_id(self.target.connect_url or "")):
            record = record.with_session(session_id)  # where its job goes: a lost run's is interrupted there
        self.record = record
        try:
            self._owner = connect_owner(record)
        except BaseException:
            with contextlib.suppress(Exception):  # nobody holds its record: a run left would only block
                end_run(record, timeout=10.0)
            raise
        return record

    def end_lost_run(self, record: RunRecord) -> list[str]:
        """A run whose supervisor is gone: interrupt the job it left on a Spark Connect server (by
        the run's tag, in the session its record holds), so that nothing of it holds the cluster
        while a retry starts afresh. Returns the operations interrupted (none for other runs)."""
        if record.connect_session_id is None or not self.target.is_connect:
            return []
        interrupted = interrupt_lost_run(
            self.target.connect_url or "", record.connect_session_id, record.run_id
        )
        self.log.warning(
            "Run %s's supervisor is gone; its Spark Connect job in session %s: %s.",
            record.run_id,
            record.connect_session_id,
            f"interrupted (operation {', '.join(interrupted)})" if interrupted else "none left to interrupt",
        )
        return interrupted

    def detach(self) -> None:
        """Leave the run on purpose (before deferring): it waits ``reattach_timeout`` for its next owner."""
        owner, self._owner = self._owner, None
        if owner is not None:
            try:
                owner.detach()
            finally:
                owner.close()

    def follow(self, record: RunRecord, handle: Callable[[Path | None], T], *, since: int = 0) -> T:
        """Own the run to its end, then hand ``handle`` rank 0's output file (None for a script).

        The run's log lines go to this hook's log (the kept ones from line ``since`` on first, when
        this is a new owner), its application to ``on_application``, its metrics to ``metrics`` (the
        history so far when this owner connected, then each new record; ``on_metrics`` hears of
        each), its final status to ``run_status`` and its world sizes to ``world_sizes``.
        A failed run raises what :meth:`run` would raise. The run is released (torn down) once the
        output is handled; when ``handle`` fails, it is kept for the next owner.
        """
        # The same run (its record may have gained a deadline or a Connect operation since).
        same_run = self.record is not None and self.record.run_id == record.run_id
        owner = self._owner if self._owner is not None and same_run else None
        if owner is None:
            owner = connect_owner(record, since=since)
        self._owner, self.record = owner, record
        self.metrics, self.run_status, self.world_sizes = list(owner.status.metrics), None, []
        if self.metrics and self.on_metrics and not owner.status.ended:
            self.on_metrics(self.metrics)  # a new owner of a run under way: the history so far at once
        try:
            status = follow_to_end(
                owner,
                record.run_id,
                on_line=lambda text: self.log.info("%s", text),
                on_application=self._application_started,
                on_metric=self._metric_reported,
            )
            self.metrics, self.run_status = list(status.metrics), status
            self.world_sizes = list(status.world_sizes)
            if self._fast is not None:
                self._fast.finish()
                self._fast = None
            if status.state != "succeeded":
                owner.release()
                raise_for_failure(status)
            with tempfile.TemporaryDirectory(prefix="torchdist-output-") as tmp:
                result = handle(owner.fetch_output(Path(tmp)))
            owner.release()
            return result
        finally:
            self._owner = None
            owner.close()

    def _submit(self, plan: SubmitPlan, staged: StagedRun) -> None:
        self.submission = submission_for(plan)
        self.metrics, self.world_sizes = [], []
        outcome, submit_error = submit_and_follow(
            self.submission,
            staged,
            on_line=self.log.info,
            on_application=self._application_started,
            on_metric=self._metric_reported,
        )
        if outcome is not None:  # the complete history (without one, what was followed live)
            self.metrics, self.world_sizes = outcome.metrics, outcome.world_sizes
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
        self.metrics.append(record)
        if self.on_metrics:
            self.on_metrics(self.metrics)

    # -- stopping -----------------------------------------------------------------------------

    def _stop_session(self, grace: float = 5.0) -> None:
        """End whatever is left of spark-submit's session (:func:`end_submission`)."""
        end_submission(self.submission, grace)

    def stop_run(self, record: RunRecord) -> bool:
        """Stop a followed run at its deadline, from another thread: over this hook's lifeline when
        it owns the run, else over a new one. False when there is nothing to stop: the run has ended
        (its result may still be on its way to this hook, and is not thrown away)."""
        if self.run_status is not None:
            return False
        owner = self._owner
        try:
            if owner is not None and self.record is not None and self.record.run_id == record.run_id:
                owner.stop()
            else:
                end_run(record, timeout=15.0)
        except (LifelineError, OSError, SparkSubmitFailed) as exc:
            self.log.warning("Could not stop run %s at its deadline: %s", record.run_id, exc)
        return True

    def on_kill(self) -> None:
        """Stop the Spark application and every process of the run (Airflow's kill or timeout).

        A supervised run is told "stop" over its lifeline, durable or not: an explicit kill is
        never taken for a lost owner."""
        owner = self._owner
        if owner is not None:
            with contextlib.suppress(LifelineError, OSError):
                owner.stop()
        elif self.record is not None:
            with contextlib.suppress(LifelineError, OSError):
                end_run(self.record, timeout=4.0)
        if self.submission is not None:
            self.submission.kill()
        self._stop_session()
        if self.staged is not None:
            self.staged.cleanup()
