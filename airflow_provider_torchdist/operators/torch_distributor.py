"""TorchDistributorOperator: templating, the spec, and XCom around :class:`TorchDistributorHook`.

The operator's settings are :class:`~airflow_provider_torchdist.spec.TrainingSpec`'s: its
signature, template fields and docs are made from the spec's fields. Values that are not templates
are checked when the DAG is parsed; after rendering, the operator builds the spec, and the hook
plans the run from it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import BaseOperator, ResumableJobMixin
from airflow.providers.common.compat.sdk import conf as airflow_conf

from airflow_provider_torchdist.errors import SparkSubmitFailed
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.links import SparkHistoryServerLink, SparkMasterAppLink, SparkUILink
from airflow_provider_torchdist.operators.lineage import inject_openlineage
from airflow_provider_torchdist.operators.outlet_events import run_extra, set_outlet_extra
from airflow_provider_torchdist.operators.xcom import METRICS_XCOM_KEY as METRICS_XCOM_KEY  # public since 0.1
from airflow_provider_torchdist.operators.xcom import WORLD_SIZES_XCOM_KEY as WORLD_SIZES_XCOM_KEY
from airflow_provider_torchdist.operators.xcom import (
    link_pusher,
    metrics_pusher,
    output_handler,
    push_link_placeholders,
    push_world_sizes,
)
from airflow_provider_torchdist.outputs import paths as run_paths
from airflow_provider_torchdist.spec import (
    SETTINGS,
    TrainingSpec,
    documented,
    signature_of,
    templated_settings,
)
from airflow_provider_torchdist.submit.checks import build_spec, check_settings
from airflow_provider_torchdist.submit.preflight import check_output_path
from airflow_provider_torchdist.submit.validation import check_args, check_train_object, is_template
from airflow_provider_torchdist.supervision.deadline import (
    TRIGGER_TIMEOUT_MARGIN_S,
    DeadlineWatch,
    seconds_left,
    timeout_error,
    try_deadline,
)
from airflow_provider_torchdist.supervision.record import RECORD_KEY, RunRecord
from airflow_provider_torchdist.supervision.task_side import (
    ACTIVE_STATES,
    GONE,
    check_deferral,
    end_run,
    run_state,
    stop_abandoned,
)
from airflow_provider_torchdist.triggers.torch_distributor import TorchDistributorTrigger

path_component = run_paths.path_component  # public since 0.1
#: What Airflow's scheduler stores for a deferred task whose trigger timed out (``next_method`` and
#: ``next_kwargs["error"]``): values kept in the metadata DB, so stable across releases, while the
#: constants naming them are Airflow's internals.
AIRFLOW_TRIGGER_FAIL = "__fail__"
AIRFLOW_TRIGGER_TIMEOUT = "Trigger timeout"
#: The ``[openlineage]`` options that default the OpenLineage settings, as for SparkSubmitOperator's
#: arguments of the same names.
OPENLINEAGE_DEFAULTS = {
    "openlineage_inject_parent_job_info": "spark_inject_parent_job_info",
    "openlineage_inject_transport_info": "spark_inject_transport_info",
}


#: ``get_job_status`` of a run whose task was cleared since it started: never reattached to.
CLEARED = "cleared"


def _cleared_since(record: RunRecord, context: Any) -> bool:
    """Whether the task was cleared since the run started: Airflow raised its ``max_tries``."""
    max_tries = getattr(context.get("ti"), "max_tries", None)
    return record.max_tries is not None and type(max_tries) is int and max_tries > record.max_tries


@documented(list(SETTINGS))
class TorchDistributorOperator(ResumableJobMixin, BaseOperator):
    """Train a PyTorch callable or script on Spark and push global rank 0's return value to XCom.

    Example::

        train = TorchDistributorOperator(
            task_id="train",
            train_object=train_fn,  # or "/path/to/train.py"
            args=[1e-3],
            kwargs={"epochs": 3},
            num_processes=2,
        )

        @task
        def evaluate(value):
            result = load_output(value)

        evaluate(train.output)

    The value in XCom is the return value itself when it is plain JSON, else an envelope that
    :func:`airflow_provider_torchdist.load_output` decodes; a script returns None.

    :param train_object: a callable, or the path of a ``.py`` training script on the worker.
    :param args: positional arguments of the callable, or a script's command-line arguments.
    :param kwargs: keyword arguments of the callable (stored and templated as ``train_kwargs``).
    """

    # ``kwargs`` cannot be a template field: Airflow 3 refuses to serialize a DAG whose operator
    # templates a name of BaseOperator.__init__'s parameters, and its **kwargs counts.
    # ``train_object`` is not one either: Airflow calls a callable template field with the context
    # (``_do_render_template_fields``, which a mapped task reaches without any override of ours),
    # and a training callable is the work itself. Only a script path renders, as ``train_script``.
    template_fields: Sequence[str] = ("train_script", "train_args", "train_kwargs", *templated_settings())
    template_fields_renderers = {"conf": "json", "train_kwargs": "json", "train_args": "json"}
    ui_color = "#ee4c2c"
    #: Where the run's record lives in ``task_state_store`` between tries (ResumableJobMixin).
    external_id_key = RECORD_KEY
    operator_extra_links = (SparkUILink(), SparkMasterAppLink(), SparkHistoryServerLink())

    def __init__(
        self,
        *,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        **base_kwargs: Any,
    ) -> None:
        settings = {name: base_kwargs.pop(name) for name in list(base_kwargs) if name in SETTINGS}
        super().__init__(**base_kwargs)
        self.train_callable: Callable[..., Any] | None = None
        self.train_script: Any = None
        self.train_object = train_object
        self.train_args = args
        self.train_kwargs = kwargs
        # Bad values fail the DAG import with a message naming the field, not the run at 3 a.m.
        for name, value in check_settings(settings, at_parse_time=True).items():
            setattr(self, name, value)
        if self.deferrable is None:
            self.deferrable = airflow_conf.getboolean("operators", "default_deferrable", fallback=False)
        for name, option in OPENLINEAGE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, airflow_conf.getboolean("openlineage", option, fallback=False))
        self._check_work(at_parse_time=True)
        self._hook: TorchDistributorHook | None = None
        self._result: Any = None
        self._followed = False

    __init__.__signature__ = signature_of(  # type: ignore[attr-defined]
        list(SETTINGS),
        leading=[
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("train_object", inspect.Parameter.KEYWORD_ONLY),
            inspect.Parameter("args", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("kwargs", inspect.Parameter.KEYWORD_ONLY, default=None),
        ],
        trailing=[inspect.Parameter("base_kwargs", inspect.Parameter.VAR_KEYWORD)],
    )

    def _check_work(self, at_parse_time: bool) -> None:
        """The callable or script and its arguments; a template is checked after rendering."""

        def ready(value: Any) -> bool:
            return not (at_parse_time and is_template(value))

        if ready(self.train_object):
            self.train_object = check_train_object(self.train_object)
        # A string that is not a template renders to itself, never to a list or dict.
        if ready(self.train_args):
            check_args(self.train_args, "args", list)
        if ready(self.train_kwargs):
            check_args(self.train_kwargs, "kwargs", dict)

    def training_spec(self, context: Any = None) -> TrainingSpec:
        """The spec of this task's run, from its rendered settings; with ``context``, the default
        checkpoint directory is this task's (the same for every try in the DAG run), and ``conf``
        carries the task's OpenLineage identity when asked for
        (:mod:`~airflow_provider_torchdist.operators.lineage`)."""
        spec = build_spec(**{name: getattr(self, name) for name in SETTINGS})
        if context is None:
            return spec
        if spec.checkpoint_dir is None:
            spec = dataclasses.replace(spec, checkpoint_dir=run_paths.default_checkpoint_dir(context["ti"]))
        conf = inject_openlineage(
            spec.conf,
            context,
            parent_job_info=bool(spec.openlineage_inject_parent_job_info),
            transport_info=bool(spec.openlineage_inject_transport_info),
        )
        added = sorted(set(conf) - set(spec.conf))
        if added:
            self.log.info("OpenLineage: the Spark application gets %s.", ", ".join(added))
            spec = dataclasses.replace(spec, conf=conf)
        return spec

    @property
    def train_object(self) -> Any:
        """The work: the training callable, or the (rendered) path of its script."""
        return self.train_callable if self.train_callable is not None else self.train_script

    @train_object.setter
    def train_object(self, value: Any) -> None:
        # A callable is kept out of the template fields; anything else (a path, a template, an
        # XComArg) is the templated ``train_script``.
        if callable(value):
            self.train_callable, self.train_script = value, None
        else:
            self.train_callable, self.train_script = None, value

    def make_hook(self, context: Any = None) -> TorchDistributorHook:
        return TorchDistributorHook(spec=self.training_spec(context))

    def execute(self, context: Any) -> Any:
        push_link_placeholders(context["ti"])
        self._check_work(at_parse_time=False)
        self._hook = self.make_hook(context)
        if callable(self.train_object):  # a script returns None: nothing is ever stored
            check_output_path(run_paths.output_base(self._hook.spec.output_path))
        if self.deferrable:
            check_deferral(
                self._hook.embedded,
                self._hook.spec.local_mode,
                airflow_conf.get("core", "executor", fallback=""),
                self.log,
            )
            record = self._live_run(context) or self._submit(context)
            try:
                self._hook.detach()  # the trigger is the next owner; until it connects, the run waits
            except Exception:
                stop_abandoned(record, context["ti"].try_number <= (self.retries or 0), self.log)
                raise
            left = seconds_left(record.deadline)
            self.defer(
                trigger=TorchDistributorTrigger(record.to_dict()),
                method_name="execute_complete",
                # The trigger stops the run at its deadline itself; Airflow's trigger timeout, a
                # little later, fails the task should no triggerer be there to (resume_execution).
                timeout=None if left is None else dt.timedelta(seconds=left + TRIGGER_TIMEOUT_MARGIN_S),
            )
        return self.execute_resumable(context)

    # -- ResumableJobMixin: the run's record in task_state_store ---------------------------------

    def submit_job(self, context: Any) -> dict[str, Any]:
        """Start the run under its supervisor; its record is what a retry reattaches with."""
        assert self._hook is not None
        record = self._hook.start_run(
            self.train_object,
            self.train_args,
            self.train_kwargs,
            durable=self.durable,
            reattach_timeout=self._hook_spec().reattach_timeout,
        )
        ti = context["ti"]
        deadline = try_deadline(ti, self.execution_timeout)
        max_tries = getattr(ti, "max_tries", None)
        max_tries = max_tries if type(max_tries) is int and max_tries >= 0 else None
        return dataclasses.replace(record, deadline=deadline, max_tries=max_tries).to_dict()

    def get_job_status(self, external_id: Any, context: Any) -> str:
        """The stored run's state (``"gone"`` when its supervisor is not there any more). A failed
        run still kept for its owner is ended here, so that its checkpoint lock is free for the next."""
        record = RunRecord.from_dict(external_id)
        if _cleared_since(record, context):
            # A clear asks for a new run. The old one may not know yet: a deferred task's trigger
            # stops it when the triggerer gets to it, which can be after this try starts.
            self.log.warning(
                "The task was cleared since run %s started: stopping it, and starting a new run.",
                record.run_id,
            )
            end_run(record)
            return CLEARED
        state = run_state(record)
        if state == "failed":
            self.log.warning(
                "The earlier run %s failed; starting afresh from its checkpoints.", record.run_id
            )
            end_run(record)
        elif state in ACTIVE_STATES:
            self.log.info(
                "Reattaching to run %s at %s:%s (%s).", record.run_id, record.host, record.port, state
            )
        elif state == GONE:
            self._end_lost_run(record)
        return state

    def is_job_active(self, status: str) -> bool:
        return status in ACTIVE_STATES

    def is_job_succeeded(self, status: str) -> bool:
        return status == "succeeded"

    def poll_until_complete(self, external_id: Any, context: Any) -> Any:
        """Own the run to its end; returns what goes to XCom (the mixin returns this on a reattach)."""
        self._result = self._follow(RunRecord.from_dict(external_id), context, ended=False)
        self._followed = True
        return self._result

    def get_job_result(self, external_id: Any, context: Any) -> Any:
        if self._followed:
            return self._result
        # An earlier try's run that succeeded and still holds its result: take it over.
        return self._follow(RunRecord.from_dict(external_id), context, ended=True)

    # -- deferral ---------------------------------------------------------------------------------

    def _live_run(self, context: Any) -> RunRecord | None:
        """An earlier try's run this try can take over when deferring, or None (a failed one ended)."""
        store = context.get("task_state_store")
        stored = store.get(self.external_id_key) if store is not None else None
        if not stored or not self.durable:
            return None
        record = RunRecord.from_dict(stored)
        state = self.get_job_status(stored, context)
        return record if state in (*ACTIVE_STATES, "succeeded") else None

    def _submit(self, context: Any) -> RunRecord:
        record = self.submit_job(context)
        store = context.get("task_state_store")
        if store is not None:
            store.set(self.external_id_key, record)
        return RunRecord.from_dict(record)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Back from the trigger: take the run's log, result and metrics as the synchronous path would."""
        self._check_work(at_parse_time=False)
        self._hook = self.make_hook(context)
        state = event.get("state")
        record = RunRecord.from_dict(event["record"])
        if state == "timeout":  # the trigger stopped the run at its deadline
            self._end_timed_out(record)
            raise timeout_error(record.run_id, record.deadline, "while the task was deferred")
        if state in ("error", "gone"):
            if state == "error":
                # The task fails: a run still there would hold its application and checkpoint lock
                # for reattach_timeout with nobody to come back for it.
                try:
                    end_run(record)
                except Exception as exc:  # the lifeline is what failed: say so, raise the trigger's error
                    self.log.warning("Could not stop run %s: %s", record.run_id, exc)
            else:
                self._end_lost_run(record)
            raise SparkSubmitFailed(f"Waiting for the training run failed: {event.get('message') or state}")
        return self._follow(record, context, ended=True)  # the trigger saw it end

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        """Airflow's own trigger timeout (``defer(timeout=...)``) fails a deferred task without a
        word to the trigger: stop the run from its record first, then fail as a timeout."""
        error = (next_kwargs or {}).get("error")
        if next_method == AIRFLOW_TRIGGER_FAIL and error == AIRFLOW_TRIGGER_TIMEOUT:
            store = context.get("task_state_store")
            stored = store.get(self.external_id_key) if store is not None else None
            if stored:
                record = RunRecord.from_dict(stored)
                self._end_timed_out(record)
                raise timeout_error(record.run_id, record.deadline, "while the task was deferred")
        return super().resume_execution(next_method, next_kwargs, context)

    def _end_timed_out(self, record: RunRecord) -> None:
        """Make sure a run stopped at its deadline is gone (its lock free for a retry) before the
        try fails; the timeout stays the task's error."""
        try:
            end_run(record, timeout=15.0)
        except Exception as exc:
            self.log.warning("Could not make sure run %s ended at its timeout: %s", record.run_id, exc)

    def _record_operation(self, store: Any, record: RunRecord, operation: str) -> None:
        """A Connect run's operation (and the session it ran in) into its record, for a retry that
        finds the supervisor gone (``end_lost_run``); the run goes on whether it is stored or not."""
        try:
            store.set(self.external_id_key, record.with_operation(operation).to_dict())
        except Exception as exc:
            self.log.warning(
                "Could not add Spark Connect operation %s to run %s's record: %s",
                operation,
                record.run_id,
                exc,
            )

    def _end_lost_run(self, record: RunRecord) -> None:
        assert self._hook is not None
        try:
            self._hook.end_lost_run(record)
        except Exception as exc:  # what the task does next says its own error
            self.log.warning(
                "Could not interrupt the Spark Connect job of lost run %s: %s", record.run_id, exc
            )

    # -- owning the run ---------------------------------------------------------------------------

    def _hook_spec(self) -> TrainingSpec:
        assert self._hook is not None
        return self._hook.spec

    def _follow(self, record: RunRecord, context: Any, *, ended: bool) -> Any:
        """Follow the run to its end as its owner and turn rank 0's output into the XCom value; the
        metric history goes to XCom as it grows (throttled) and whole at the end, and a succeeded
        run's world sizes to XCom and its summary into the events of the ``outlets`` assets.

        A run still going (not ``ended``) is held to its deadline: one already past is stopped
        before it is followed, else a :class:`DeadlineWatch` stops it when the deadline passes."""
        hook = self._hook
        assert hook is not None
        ti = context["ti"]
        deadline = None if ended else record.deadline
        if deadline is not None and seconds_left(deadline) == 0:
            self.log.warning("Run %s is past its execution_timeout: stopping it.", record.run_id)
            self._end_timed_out(record)
            raise timeout_error(record.run_id, deadline, "before this try could take it over")
        hook.on_application = link_pusher(ti)
        if (store := context.get("task_state_store")) is not None:
            hook.on_operation = lambda operation: self._record_operation(store, record, operation)
        metrics = metrics_pusher(ti)
        hook.on_metrics = metrics.offer
        followed = False
        try:
            with DeadlineWatch(deadline, lambda: hook.stop_run(record)) as watch:
                try:
                    value = hook.follow(record, output_handler(ti, hook.spec))
                except Exception as exc:
                    if watch.expired:  # the run failed because the watch stopped it
                        raise timeout_error(record.run_id, deadline, "while it trained") from exc
                    raise
            followed = True
        except Exception:
            stop_abandoned(record, context["ti"].try_number <= (self.retries or 0), self.log)
            raise
        finally:
            # The metric history is worth having after a failure too (the last loss before it),
            # but a failed push must not hide the run's own error.
            try:
                metrics.close(hook.metrics or None)
            except Exception:
                if followed:
                    raise
                self.log.warning("Could not push the final metric history.", exc_info=True)
        push_world_sizes(ti, hook.world_sizes)
        if self.outlets and hook.run_status is not None:
            # The size it ended with: an elastic run's last one, else the one it had throughout.
            world_size = hook.world_sizes[-1]["world_size"] if hook.world_sizes else hook.spec.max_processes
            set_outlet_extra(context, self.outlets, run_extra(hook.run_status, value, world_size))
        return value

    def default_checkpoint_dir(self, context: Any) -> str:
        """``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>[@map]`` (see :mod:`~airflow_provider_torchdist.outputs.paths`)."""
        return run_paths.default_checkpoint_dir(context["ti"])

    def output_base(self) -> str:
        """``output_path``, or ``file://$AIRFLOW_HOME/torchdist-outputs``."""
        return run_paths.output_base(self.output_path)

    def output_uri(self, context: Any) -> str:
        """Where this try's large output goes: ``<output_path>/<dag>/<run>/<task>[@map]-try<n>.pkl``."""
        return run_paths.output_uri(self.output_path, context["ti"])

    def on_kill(self) -> None:
        if self._hook is not None:
            self._hook.on_kill()
