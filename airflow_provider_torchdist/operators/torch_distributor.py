"""TorchDistributorOperator: templating, the spec, and the start of a run (its control is
:mod:`~airflow_provider_torchdist.operators.run_control`'s).

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

from airflow.providers.common.compat.sdk import BaseOperator, XComArg
from airflow.providers.common.compat.sdk import conf as airflow_conf

from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.links import (
    MlflowRunLink,
    SparkHistoryServerLink,
    SparkMasterAppLink,
    SparkUILink,
)
from airflow_provider_torchdist.operators.checkpoint_registry import with_run_identity
from airflow_provider_torchdist.operators.executors import check_deferral, task_executor
from airflow_provider_torchdist.operators.lineage import inject_openlineage
from airflow_provider_torchdist.operators.run_control import SupervisedRunMixin
from airflow_provider_torchdist.operators.tracking.task_run import default_mlflow_conn_id, open_for
from airflow_provider_torchdist.operators.xcom import METRICS_XCOM_KEY as METRICS_XCOM_KEY  # public since 0.1
from airflow_provider_torchdist.operators.xcom import WORLD_SIZES_XCOM_KEY as WORLD_SIZES_XCOM_KEY
from airflow_provider_torchdist.operators.xcom import (
    push_link_placeholders,
)
from airflow_provider_torchdist.outputs import run_paths
from airflow_provider_torchdist.spec import (
    SETTINGS,
    TrainingSpec,
    documented,
    signature_of,
    templated_settings,
)
from airflow_provider_torchdist.submit.argument_names import refuse_unknown_operator_arguments
from airflow_provider_torchdist.submit.checks import build_spec, check_settings
from airflow_provider_torchdist.submit.local_cores import warn_at_parse
from airflow_provider_torchdist.submit.preflight import check_output_path
from airflow_provider_torchdist.submit.script_args import script_argv
from airflow_provider_torchdist.submit.script_flags import script_flags
from airflow_provider_torchdist.submit.validation import check_args, check_train_object, is_template
from airflow_provider_torchdist.supervision.deadline import (
    TRIGGER_TIMEOUT_MARGIN_S,
    seconds_left,
)
from airflow_provider_torchdist.supervision.task_side import stop_abandoned
from airflow_provider_torchdist.triggers.torch_distributor import TorchDistributorTrigger

path_component = run_paths.path_component  # public since 0.1
#: The ``[openlineage]`` options that default the OpenLineage settings, as for SparkSubmitOperator's
#: arguments of the same names.
OPENLINEAGE_DEFAULTS = {
    "openlineage_inject_parent_job_info": "spark_inject_parent_job_info",
    "openlineage_inject_transport_info": "spark_inject_transport_info",
}


@documented(list(SETTINGS))
class TorchDistributorOperator(SupervisedRunMixin, BaseOperator):
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
    :func:`airflow_provider_torchdist.load_output` decodes. A script's rank 0 hands on a value with
    :func:`airflow_provider_torchdist.set_output` (None if it never calls it). The run's checkpoint
    directory is pushed too, under the key ``checkpoint_dir``.

    :param train_object: a callable, or the path of a ``.py`` training script on the worker.
    :param args: positional arguments of the callable, or a script's command-line arguments.
    :param kwargs: keyword arguments of the callable, or a script's command-line flags after
        ``args`` (``{"epochs": 3, "amp": True}`` gives ``--epochs 3 --amp``; see
        :mod:`~airflow_provider_torchdist.submit.script_flags`). Stored and templated as
        ``train_kwargs``.
    """

    # ``kwargs`` cannot be a template field: Airflow 3 refuses to serialize a DAG whose operator
    # templates a name of BaseOperator.__init__'s parameters, and its **kwargs counts.
    # ``train_object`` is not one either: Airflow calls a callable template field with the context
    # (``_do_render_template_fields``, which a mapped task reaches without any override of ours),
    # and a training callable is the work itself. Only a script path renders, as ``train_script``.
    template_fields: Sequence[str] = ("train_script", "train_args", "train_kwargs", *templated_settings())
    template_fields_renderers = {
        "conf": "json",
        "train_kwargs": "json",
        "train_args": "json",
        "train_data_args": "json",
    }
    ui_color = "#ee4c2c"
    operator_extra_links = (SparkUILink(), SparkMasterAppLink(), SparkHistoryServerLink(), MlflowRunLink())

    def __init__(
        self,
        *,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        **base_kwargs: Any,
    ) -> None:
        # A typo fails the DAG import naming the closest argument, not as BaseOperator's **kwargs.
        refuse_unknown_operator_arguments(type(self), base_kwargs, base_kwargs.get("task_id"))
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
        warn_at_parse(self.local_mode, self.num_processes)  # more local ranks than cores
        if self.deferrable is None:
            self.deferrable = airflow_conf.getboolean("operators", "default_deferrable", fallback=False)
        for name, option in OPENLINEAGE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, airflow_conf.getboolean("openlineage", option, fallback=False))
        self._check_work(at_parse_time=True)
        # A set connection (or [torchdist] mlflow_conn_id) without the MLflow client fails the import.
        self.mlflow_conn_id = default_mlflow_conn_id(self.mlflow_conn_id)
        self._hook: TorchDistributorHook | None = None
        self._result: Any = None
        self._followed = False
        self._tracking = None

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

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """``BaseOperator.partial``, with a typo named as the constructor names one (Airflow's own
        check says only "unexpected keyword argument")."""
        refuse_unknown_operator_arguments(cls, kwargs, kwargs.get("task_id"))
        return super().partial(**kwargs)

    def _check_work(self, at_parse_time: bool) -> None:
        """The callable or script and its arguments; a template is checked after rendering."""

        def ready(value: Any) -> bool:
            return not (at_parse_time and is_template(value))

        def lazy(value: Any) -> bool:
            return at_parse_time and isinstance(value, XComArg)

        if ready(self.train_object):
            self.train_object = check_train_object(self.train_object)
        # A string that is not a template renders to itself, never to a list or dict.
        if ready(self.train_args):
            check_args(self.train_args, "args", list)
            if not callable(self.train_object):  # a script's args are its command line
                script_argv(
                    [a for a in self.train_args or () if ready(a)], lazy=(XComArg,) if at_parse_time else ()
                )
        if ready(self.train_kwargs):
            kwargs = check_args(self.train_kwargs, "kwargs", dict)
            if not callable(self.train_object):
                # A script's kwargs are its flags: a key or value no flag can carry fails the DAG
                # import. Templates and upstream values are checked once rendered (staging).
                script_flags({k: v for k, v in kwargs.items() if ready(v) and not lazy(v)})

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
        spec = with_run_identity(spec, context["ti"])  # its ranks resume this DAG run's checkpoints only
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
        # Scripts too: a script's rank 0 may set_output() a value as large as any return value.
        check_output_path(run_paths.output_base(self._hook.spec.output_path))
        # The MLflow run, before anything is submitted: a bad URI or credentials fail the task here.
        self._tracking = open_for(self, self._hook, context)
        if self.deferrable:
            check_deferral(
                self._hook.embedded,
                self._hook.spec.local_mode,
                task_executor(context["ti"]),
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
                trigger=TorchDistributorTrigger(record.to_dict(), task_binding=record.task),
                method_name="execute_complete",
                # The trigger stops the run at its deadline itself; Airflow's trigger timeout, a
                # little later, fails the task should no triggerer be there to (resume_execution).
                timeout=None if left is None else dt.timedelta(seconds=left + TRIGGER_TIMEOUT_MARGIN_S),
            )
        return self.execute_resumable(context)

    def default_checkpoint_dir(self, context: Any) -> str:
        """``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>[@map]`` (see :mod:`~airflow_provider_torchdist.outputs.run_paths`)."""
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
