"""TorchDistributorHook: a spec in, rank 0's value out; spark-submit through the Spark provider's hook.

The hook plans and submits. It resolves the connection (:mod:`~airflow_provider_torchdist.connection`),
runs the checks that can fail before anything starts (:mod:`~airflow_provider_torchdist.preflight`),
stages the work (:mod:`~airflow_provider_torchdist.staging`), turns all of it into a plain
:class:`~airflow_provider_torchdist.submit_plan.SubmitPlan`, and runs that through
``SparkSubmitHook``'s public constructor and ``submit()``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from airflow.providers.common.compat.sdk import AirflowException, BaseHook

from airflow_provider_torchdist.connection import CONN_TYPE, SparkTarget, resolve_target
from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed, TrainingFailed
from airflow_provider_torchdist.fast_start import FastStart, plan_fast_start
from airflow_provider_torchdist.lifeline import AppEvent, DoneEvent, LifelineError, LineEvent, OwnerConnection
from airflow_provider_torchdist.masking import mask_setting_secrets
from airflow_provider_torchdist.preflight import (
    check_checkpoint_dir,
    check_cluster_capacity,
    check_gpu_conf,
    check_master_reachable,
    check_spark_binary,
)
from airflow_provider_torchdist.processes import end_session
from airflow_provider_torchdist.run_follower import RunFollower
from airflow_provider_torchdist.run_owner import connect_owner, end_run, raise_for_failure, start_supervisor
from airflow_provider_torchdist.run_record import RunRecord
from airflow_provider_torchdist.settings_checks import build_spec
from airflow_provider_torchdist.spark.checkpoints import CHECKPOINT_ENV
from airflow_provider_torchdist.spark.events import emit
from airflow_provider_torchdist.spark.outcome import Outcome
from airflow_provider_torchdist.spark.output_store import read_output
from airflow_provider_torchdist.spark.owner import write_owner_token
from airflow_provider_torchdist.spec import (
    DEFAULT_CONN_ID,
    DEFAULT_REATTACH_TIMEOUT,
    OWNER,
    RUN,
    SETTINGS,
    SUBMIT,
    XCOM,
    TrainingSpec,
    documented,
    settings_for,
    signature_of,
)
from airflow_provider_torchdist.staging import StagedRun, stage_run
from airflow_provider_torchdist.submit_plan import (
    Submission,
    SubmitPlan,
    build_plan,
    spark_home,
    spark_properties,
    submit_environment,
)
from airflow_provider_torchdist.validation import check_args, check_deploy_mode

T = TypeVar("T")


def lifeline_host() -> str:
    """Where a supervisor listens for its owners: ``[torchdist] lifeline_host``, default 127.0.0.1.

    A deferred run's trigger connects from the triggerer: when that runs on another machine than
    the workers, set it to an address of the worker that the triggerer can reach."""
    from airflow.configuration import conf

    return conf.get("torchdist", "lifeline_host", fallback="127.0.0.1") or "127.0.0.1"


#: The settings the hook takes (the operator's less how outputs travel through XCom).
HOOK_SETTINGS = settings_for(RUN, SUBMIT)
_POSITIONAL = ("num_processes", "local_mode", "use_gpu")


@documented([n for n in HOOK_SETTINGS if n != "spark_submit_kwargs"])
class TorchDistributorHook(BaseHook):
    """Run a PyTorch training callable or script on Spark and return rank 0's value.

    Semantics follow PySpark's ``TorchDistributor``. A callable runs as ``fn(*args, **kwargs)`` on
    every rank; a script path runs like ``torchrun script.py *args``. With no Spark connection
    configured, the run goes to an embedded ``local[N]`` master on this machine. Every setting of
    :class:`~airflow_provider_torchdist.spec.TrainingSpec` is a keyword argument; any other keyword
    is a ``SparkSubmitHook`` argument (``executor_memory``, ``driver_memory``, ``name``, ...). Or
    pass a ready ``spec=`` (:func:`~airflow_provider_torchdist.settings_checks.build_spec`).

    :param spec: a ready, validated spec instead of the settings as keywords.
    :param spark_submit_kwargs: any other keyword: a ``SparkSubmitHook`` argument.

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
        num_processes: int = 1,
        local_mode: bool = False,
        use_gpu: bool = False,
        *,
        spec: TrainingSpec | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if spec is None:
            operator_only = sorted(set(settings) & set(settings_for(XCOM)))
            if operator_only:
                raise InvalidTrainingConfig(
                    f"{', '.join(operator_only)} say(s) how the operator puts rank 0's value in XCom; "
                    "the hook returns the value itself. Pass it to TorchDistributorOperator instead."
                )
            lifetime = sorted(set(settings) & set(settings_for(OWNER)))
            if lifetime:
                raise InvalidTrainingConfig(
                    f"{', '.join(lifetime)} say(s) how long a run lives apart from its Airflow task: "
                    "settings of TorchDistributorOperator. The hook's run() trains in this process; "
                    "for a detached run use hook.start_run(..., durable=..., reattach_timeout=...)."
                )
            given = {"num_processes": num_processes, "local_mode": local_mode, "use_gpu": use_gpu}
            submit_kwargs = {k: settings.pop(k) for k in list(settings) if k not in SETTINGS}
            submit_kwargs.update(settings.pop("spark_submit_kwargs", None) or {})
            spec = build_spec(**given, **settings, spark_submit_kwargs=submit_kwargs)
        self.spec = spec
        # Airflow then redacts them from every log line and error.
        for values in (spec.conf, spec.rank_env, spec.env_vars):
            mask_setting_secrets(values)
        self.target: SparkTarget = resolve_target(spec, self.log)
        check_deploy_mode(self.target.deploy_mode)
        #: Called with (application id, Spark UI URL or None, master's application page or None) as
        #: soon as the driver reports them; the operator pushes them to XCom for the extra links.
        self.on_application: Callable[[str, str | None, str | None], None] | None = None
        self.application_id: str | None = None
        #: What the last run's training code reported with ``report()``, in order.
        self.metrics: list[dict[str, Any]] = []
        self.plan: SubmitPlan | None = None
        #: The last run's spark-submit (its ``session`` is spark-submit's session id, once started).
        self.submission: Submission | None = None
        #: The run under way: its private staging directory and job spec.
        self.staged: StagedRun | None = None
        #: The supervised run this hook started or follows, and its lifeline while it owns it.
        self.record: RunRecord | None = None
        self._owner: OwnerConnection | None = None
        self._fast: FastStart | None = None

    __init__.__signature__ = signature_of(  # type: ignore[attr-defined]
        [n for n in HOOK_SETTINGS if n not in _POSITIONAL and n != "spark_submit_kwargs"],
        leading=[
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(
                inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=SETTINGS[n].default)
                for n in _POSITIONAL
            ),
        ],
        trailing=[
            inspect.Parameter("spec", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("spark_submit_kwargs", inspect.Parameter.VAR_KEYWORD),
        ],
    )

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
        (:func:`~airflow_provider_torchdist.results.output_to_xcom`).

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
            return handle(None if staged.spec.kind == "script" else staged.output_path)
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
        spec, target = self.spec, self.target
        environ = {**os.environ, **submit_environment(spec, target, {})}
        props = spark_properties(spec, target, spark_home(target, environ), environ)
        check_gpu_conf(spec, target, props)
        env = submit_environment(spec, target, props)
        check_spark_binary(target.spark_binary, {**os.environ, **env}.get("PATH"))
        check_master_reachable(target.master, spec.conn_id)
        check_checkpoint_dir(spec.checkpoint_dir)
        slot_timeout = check_cluster_capacity(spec, target, self.log)
        rank_env = dict(spec.rank_env)
        if spec.checkpoint_dir:
            rank_env[CHECKPOINT_ENV] = str(spec.checkpoint_dir)
        staged = stage_run(
            train_object,
            check_args(args, "args", list),
            check_args(kwargs, "kwargs", dict),
            base_dir=spec.staging_dir,
            training=spec,
            slot_timeout=slot_timeout,
            rank_env=rank_env,
        )
        self.staged = staged
        emit("staged")
        try:
            fast = plan_fast_start(spec, target, {**os.environ, **env}, props)
            self.plan = build_plan(
                spec,
                target,
                application=str(staged.driver_path),
                application_args=[str(staged.spec_path)],
                files=staged.files,
                py_files=[staged.py_files],
                properties=props,
                properties_dir=staged.dir,
                env={**env, **fast.env},
            )
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
        ``reattach_timeout`` seconds for the next (see :mod:`~airflow_provider_torchdist.run_owner`).
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
        self.record = record
        self._owner = connect_owner(record)
        return record

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
        this is a new owner), its application to ``on_application``, its metrics to ``metrics``.
        A failed run raises what :meth:`run` would raise. The run is released (torn down) once the
        output is handled; when ``handle`` fails, it is kept for the next owner.
        """
        owner = self._owner if self._owner is not None and self.record == record else None
        if owner is None:
            owner = connect_owner(record, since=since)
        self._owner, self.record = owner, record
        try:
            status = None
            for event in owner.events():
                if isinstance(event, LineEvent):
                    self.log.info("%s", event.text)
                elif isinstance(event, AppEvent):
                    self._application_started(event.app_id, event.ui_url)
                elif isinstance(event, DoneEvent):
                    status = event.status
            if status is None:
                raise SparkSubmitFailed(
                    f"The lifeline of run {record.run_id} ended without the run's outcome."
                )
            self.metrics = list(status.metrics)
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
        submit_error: AirflowException | None = None
        self.submission = Submission(plan)
        follower = RunFollower(
            staged.dir,
            write_owner_token(staged.dir),
            on_line=self.log.info,
            on_application=self._application_started,
            on_metric=lambda record: None,  # the complete history comes with the outcome
        )
        follower.start()
        try:
            self.submission.run()
        except AirflowException as exc:
            submit_error = exc
        finally:
            follower.stop()
        outcome = Outcome.read(staged.dir)
        emit("outcome_read")
        self.metrics = outcome.metrics if outcome else []
        if outcome is None:
            raise SparkSubmitFailed(
                f"The Spark application ended before the training driver reported an outcome: {submit_error}"
            ) from submit_error
        if not outcome.ok:
            raise TrainingFailed(outcome.failures, outcome.error)
        if staged.spec.kind == "callable" and not staged.output_path.exists():
            raise SparkSubmitFailed("Training succeeded but rank 0's return value never reached the driver.")

    def _application_started(self, app_id: str, ui_url: str | None) -> None:
        """The driver's SparkContext is up: note it, and tell the operator (the extra links)."""
        if self.application_id is not None:
            return
        self.application_id = app_id
        web_ui = self.target.master_web_ui
        master_page = f"{web_ui.rstrip('/')}/app/?appId={app_id}" if web_ui else None
        if self.on_application:
            self.on_application(app_id, ui_url, master_page)

    # -- stopping -----------------------------------------------------------------------------

    def _stop_session(self, grace: float = 5.0) -> None:
        """End whatever is left of spark-submit's session: JVM, Python driver, Spark's Python daemon
        and workers (which move to process groups of their own, but stay in the session), local ranks."""
        if self.submission is not None and self.submission.session is not None:
            end_session(self.submission.session, grace)
        emit("session_ended")

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
