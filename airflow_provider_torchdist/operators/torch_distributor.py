"""TorchDistributorOperator: templating, validation and XCom around :class:`TorchDistributorHook`."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import BaseOperator

from airflow_provider_torchdist.hooks.torch_distributor import DEFAULT_CONN_ID, TorchDistributorHook
from airflow_provider_torchdist.links import (
    SPARK_MASTER_APP_XCOM_KEY,
    SPARK_UI_XCOM_KEY,
    SparkMasterAppLink,
    SparkUILink,
)
from airflow_provider_torchdist.results import DEFAULT_MAX_XCOM_OUTPUT_BYTES, output_to_xcom
from airflow_provider_torchdist.spark.checkpoints import CHECKPOINT_ENV
from airflow_provider_torchdist.validation import (
    check_args,
    check_bool,
    check_deploy_mode,
    check_int,
    check_topology,
    check_train_object,
    check_unencrypted_allowed,
    is_template,
)


def _airflow_home() -> str:
    return os.path.expanduser(os.environ.get("AIRFLOW_HOME", "~/airflow"))


#: XCom key of the list of ``report()`` records: ``[{"rank": 0, "step": 3, "time": ..., "loss": 0.12}, ...]``.
METRICS_XCOM_KEY = "metrics"


class TorchDistributorOperator(BaseOperator):
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
    :param num_processes: total number of ranks.
    :param local_mode: run all ranks on the Spark driver instead of Spark executors.
    :param use_gpu: map each task's Spark-assigned GPUs to its ranks and use NCCL.
    :param nproc_per_node: ranks per Spark task in distributed mode.
    :param max_restarts: restarts of the worker group by torchrun's agent.
    :param rendezvous_timeout: seconds the ranks may take to find each other.
    :param slot_timeout: seconds to wait for executors when the cluster's capacity is unknown.
    :param socket_ifname: network interface for gloo/NCCL (default: the one carrying the task's address).
    :param conn_id: Spark connection; the default ``spark_default``, when undefined, means an
        embedded local master.
    :param conf: Spark configuration properties (templated, shown as JSON).
    :param env_vars: environment for spark-submit, as in ``SparkSubmitOperator``.
    :param rank_env: environment variables for every rank.
    :param output_path: where outputs bigger than ``max_xcom_output_bytes`` are stored (any
        ``ObjectStoragePath`` URI: ``s3://bucket/prefix``, ``file:///shared/dir``); XCom then holds a
        signed reference. Default: ``$AIRFLOW_HOME/torchdist-outputs`` on the worker.
    :param max_xcom_output_bytes: largest pickled output carried inline in XCom (default 4 MiB).
    :param checkpoint_dir: the directory ranks find in ``TORCHDIST_CHECKPOINT_DIR``; default
        ``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>``, the same for every try.
    :param allow_unencrypted: run even when ``spark.ssl.enabled=true`` (torch traffic is not encrypted).
    :param spark_submit_kwargs: other ``SparkSubmitHook`` settings: ``executor_memory``,
        ``driver_memory``, ``executor_cores``, ``num_executors``, ``total_executor_cores``,
        ``name``, ``verbose``, ``properties_file``, ``spark_binary``, ...
    """

    # ``kwargs`` cannot be a template field: Airflow 3 refuses to serialize a DAG whose operator
    # templates a name of BaseOperator.__init__'s parameters, and its **kwargs counts.
    template_fields: Sequence[str] = (
        "train_object",
        "train_args",
        "train_kwargs",
        "num_processes",
        "local_mode",
        "use_gpu",
        "nproc_per_node",
        "max_restarts",
        "socket_ifname",
        "conf",
        "env_vars",
        "rank_env",
        "output_path",
        "checkpoint_dir",
        "conn_id",
    )
    template_fields_renderers = {"conf": "json", "train_kwargs": "json", "train_args": "json"}
    ui_color = "#ee4c2c"
    operator_extra_links = (SparkUILink(), SparkMasterAppLink())

    def __init__(
        self,
        *,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        num_processes: int | str = 1,
        local_mode: bool | str = False,
        use_gpu: bool | str = False,
        nproc_per_node: int | str = 1,
        max_restarts: int | str = 0,
        rendezvous_timeout: int = 300,
        slot_timeout: float = 20.0,
        socket_ifname: str | None = None,
        conn_id: str = DEFAULT_CONN_ID,
        conf: dict[str, Any] | None = None,
        env_vars: dict[str, Any] | None = None,
        rank_env: dict[str, str] | None = None,
        output_path: str | None = None,
        max_xcom_output_bytes: int = DEFAULT_MAX_XCOM_OUTPUT_BYTES,
        checkpoint_dir: str | None = None,
        allow_unencrypted: bool = False,
        spark_submit_kwargs: dict[str, Any] | None = None,
        **base_kwargs: Any,
    ) -> None:
        super().__init__(**base_kwargs)
        self.train_object = train_object
        self.train_args = args
        self.train_kwargs = kwargs
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts
        self.rendezvous_timeout = rendezvous_timeout
        self.slot_timeout = slot_timeout
        self.socket_ifname = socket_ifname
        self.conn_id = conn_id
        self.conf = conf
        self.env_vars = env_vars
        self.rank_env = rank_env
        self.output_path = output_path
        self.max_xcom_output_bytes = max_xcom_output_bytes
        self.checkpoint_dir = checkpoint_dir
        self.allow_unencrypted = allow_unencrypted
        self.spark_submit_kwargs = dict(spark_submit_kwargs or {})
        self._hook: TorchDistributorHook | None = None
        self._validate(at_parse_time=True)

    def _validate(self, at_parse_time: bool) -> None:
        """Check every value that is not a template yet; after rendering, check all of them.

        Bad values fail the DAG import with a message naming the field, not the run at 3 a.m.
        """

        def ready(value: Any) -> bool:
            return not (at_parse_time and is_template(value))

        if ready(self.train_object):
            self.train_object = check_train_object(self.train_object)
        # A string that is not a template renders to itself, never to a list or dict.
        if ready(self.train_args):
            check_args(self.train_args, "args", list)
        if ready(self.train_kwargs):
            check_args(self.train_kwargs, "kwargs", dict)
        if all(ready(v) for v in (self.num_processes, self.nproc_per_node, self.local_mode)):
            self.num_processes, self.nproc_per_node, self.local_mode = check_topology(
                self.num_processes, self.nproc_per_node, self.local_mode
            )
        if ready(self.use_gpu):
            self.use_gpu = check_bool(self.use_gpu, "use_gpu")
        if ready(self.max_restarts):
            self.max_restarts = check_int(self.max_restarts, "max_restarts", minimum=0)
        # What the hook would refuse at the start of the task, refused when the DAG is parsed: only
        # client deploy mode, and no spark.ssl.enabled without allow_unencrypted.
        check_deploy_mode(self.spark_submit_kwargs.get("deploy_mode"))
        if isinstance(self.conf, dict) and not is_template(self.conf.get("spark.ssl.enabled")):
            check_unencrypted_allowed(self.conf, check_bool(self.allow_unencrypted, "allow_unencrypted"))
        if not at_parse_time:  # a template that rendered to a string is not a list / dict
            check_args(self.train_args, "args", list)
            check_args(self.train_kwargs, "kwargs", dict)

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        # Airflow calls a callable template field as ``value(context=..., jinja_env=...)``; a
        # training callable is the work itself, not a template, so only a script path renders.
        train_object = self.train_object
        if callable(train_object):
            self.train_object = None
        try:
            super().render_template_fields(context, jinja_env)
        finally:
            if callable(train_object):
                self.train_object = train_object

    def make_hook(self) -> TorchDistributorHook:
        return TorchDistributorHook(
            num_processes=self.num_processes,
            local_mode=self.local_mode,
            use_gpu=self.use_gpu,
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            rendezvous_timeout=self.rendezvous_timeout,
            slot_timeout=self.slot_timeout,
            socket_ifname=self.socket_ifname,
            allow_unencrypted=self.allow_unencrypted,
            checkpoint_dir=self.checkpoint_dir,
            conn_id=self.conn_id,
            conf=self.conf,
            env_vars=self.env_vars,
            rank_env=self.rank_env,
            **self.spark_submit_kwargs,
        )

    def execute(self, context: Any) -> Any:
        self._validate(at_parse_time=False)
        self._hook = self.make_hook()
        ti = context["ti"]

        def push_links(app_id: str, ui: str | None, master_page: str | None) -> None:
            # Pushed while the run goes on, so the extra links work before the task ends.
            if ui:
                ti.xcom_push(key=SPARK_UI_XCOM_KEY, value=ui)
            if master_page:
                ti.xcom_push(key=SPARK_MASTER_APP_XCOM_KEY, value=master_page)

        self._hook.on_application = push_links
        store_uri = self.output_uri(context)
        if self.checkpoint_dir is None:
            self._hook.checkpoint_dir = self.default_checkpoint_dir(context)
            self._hook.rank_env[CHECKPOINT_ENV] = self._hook.checkpoint_dir
        try:
            return self._hook.run_to_path(
                self.train_object,
                self.train_args,
                self.train_kwargs,
                lambda path: output_to_xcom(
                    path, max_inline_bytes=self.max_xcom_output_bytes, store_uri=store_uri
                ),
            )
        finally:
            # The metric history is worth having after a failure too (the last loss before it).
            if self._hook.metrics:
                ti.xcom_push(key=METRICS_XCOM_KEY, value=self._hook.metrics)

    def default_checkpoint_dir(self, context: Any) -> str:
        """``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>[-map]``: the same for every try of
        this task in this DAG run, so a retry resumes where the last try stopped."""
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        task = ti.task_id if map_index in (-1, None) else f"{ti.task_id}-{map_index}"
        return os.path.join(_airflow_home(), "torchdist-checkpoints", ti.dag_id, ti.run_id, task)

    def output_uri(self, context: Any) -> str:
        """Where this try's large output goes: ``<output_path>/<dag>/<run>/<task>[-map]-try<n>.pkl``."""
        ti = context["ti"]
        base = self.output_path or "file://" + os.path.join(_airflow_home(), "torchdist-outputs")
        map_index = getattr(ti, "map_index", -1)
        name = f"{ti.task_id}{'' if map_index in (-1, None) else f'-{map_index}'}-try{ti.try_number}.pkl"
        return "/".join([base.rstrip("/"), ti.dag_id, ti.run_id, name])

    def on_kill(self) -> None:
        if self._hook is not None:
            self._hook.on_kill()
