"""``TrainingSpec``: every setting of a training run, declared, documented and validated once.

Each setting is one field below, with its default, whether the operator templates it, what it
means (the docs of the operator and the hook are made from these), and how it is checked. The
operator builds a spec after rendering its templates (and checks the non-templated values when the
DAG is parsed); the hook takes the spec and plans the run from it; the Spark side reads it inside
:class:`~airflow_provider_torchdist.spark.wire.jobspec.JobSpec`, less the settings only ``spark-submit``
needs.

Adding a setting means: a field here (default, template flag, docs, check), its use, its row in
docs/reference.md, its tests (docs/contributing.md says where each goes). The operator's and hook's signatures,
template fields and docstrings follow.

Standard library only: the Spark side imports this module too. The checks, which raise Airflow's
exceptions, are :mod:`~airflow_provider_torchdist.submit.checks`'s; a spec is built through them.

Example::

    spec = build_spec(num_processes=4, nproc_per_node=2)   # submit.checks.build_spec
    spec.num_nodes  # 2
"""

# size: the one typed spec of every setting, each with its documentation; it stays whole on purpose.

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CONN_ID = "spark_default"
#: More ranks than any Spark cluster could schedule as one barrier stage: a typo, not a job.
MAX_NUM_PROCESSES = 100_000
DEFAULT_MAX_XCOM_OUTPUT_BYTES = 4 * 1024 * 1024

#: Who takes a setting: both the operator and the hook (``run``), or the operator only (``xcom``:
#: how the value travels through XCom; ``owner``: how long the run lives apart from its task;
#: ``lineage``: what of the task's OpenLineage identity the Spark application gets, which needs the
#: task's context), or neither on the Spark side (``submit``: spark-submit's).
RUN, XCOM, OWNER, LINEAGE, SUBMIT = "run", "xcom", "owner", "lineage", "submit"
#: ``tracking``: where the operator logs the run in MLflow (the task's side only: the ranks need no
#: credentials and no route to the tracking server).
TRACKING = "tracking"
#: ``reattach_timeout``'s default: how long a run waits for a new owner (10 minutes).
DEFAULT_REATTACH_TIMEOUT = 600.0
#: ``stop_grace_period``'s default: what SageMaker and Kubernetes give a stopped job (30 s).
DEFAULT_STOP_GRACE_PERIOD = 30.0
#: ``hang_timeout``'s default (5 minutes): longer than any one call a healthy step blocks in,
#: shorter than torch's own collective timeouts (NCCL 10 minutes, gloo 30); see docs/hangs.md.
DEFAULT_HANG_TIMEOUT = 300.0


def setting(default: Any, doc: str, *, templated: bool = False, scope: str = RUN, check: str = "") -> Any:
    """A field of :class:`TrainingSpec`: its default, docs, template flag, scope and check (a name
    of :data:`airflow_provider_torchdist.submit.checks.CHECKS`)."""
    meta = {"doc": doc, "templated": templated, "scope": scope, "check": check}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainingSpec:
    """The settings of one training run, validated (see the module docstring)."""

    num_processes: int | str = setting(
        1,
        'total number of ranks (the world size); ``"MIN:MAX"`` (such as ``"2:4"``) makes the run '
        "elastic: it starts with at least MIN ranks, takes in up to MAX, and survives losing nodes "
        "while MIN remain (distributed mode only; both bounds multiples of ``nproc_per_node``).",
        templated=True,
        check="world_size",
    )
    local_mode: bool = setting(
        False, "run all ranks on the Spark driver instead of Spark executors.", templated=True, check="bool"
    )
    use_gpu: bool = setting(
        False, "map each task's Spark-assigned GPUs to its ranks and use NCCL.", templated=True, check="bool"
    )
    nproc_per_node: int = setting(
        1,
        "ranks per Spark task in distributed mode; ``num_processes`` must divide by it.",
        templated=True,
        check="positive_int",
    )
    max_restarts: int = setting(
        0,
        "how often torchrun's agent restarts the worker group after a failure.",
        templated=True,
        check="non_negative_int",
    )
    rendezvous_timeout: int = setting(
        300, "seconds the ranks may take to find each other.", check="int_timeout"
    )
    join_window: int = setting(
        10,
        "elastic runs: seconds the rendezvous waits for more ranks, up to MAX, once MIN have joined "
        "(torchrun's ``last_call_timeout``, which must be at least 1 s), at the start and after "
        "each change of world size.",
        templated=True,
        check="positive_int",
    )
    # 60, not 20: over Spark Connect the wait includes the executors' Python workers starting, and
    # a cold server's first job took over 20 s for that on a loaded machine; failing a healthy run
    # is worse than a too-small cluster's failure coming 40 s later.
    slot_timeout: float = setting(
        60.0,
        "seconds to wait for executors to offer the barrier stage's slots when the cluster's "
        "capacity is unknown.",
        check="float_timeout",
    )
    socket_ifname: str | None = setting(
        None,
        "network interface for gloo/NCCL (default: the one carrying the task's address).",
        templated=True,
        check="optional_str",
    )
    conn_id: str = setting(
        DEFAULT_CONN_ID,
        "the Spark connection; the default ``spark_default``, when undefined, means an embedded "
        "local Spark master on this machine.",
        templated=True,
        scope=SUBMIT,
        check="non_empty_str",
    )
    conf: dict[str, Any] = setting(
        {}, "Spark configuration properties.", templated=True, scope=SUBMIT, check="str_dict"
    )
    env_vars: dict[str, Any] = setting(
        {},
        "environment for spark-submit, as in ``SparkSubmitOperator``.",
        templated=True,
        scope=SUBMIT,
        check="str_dict",
    )
    rank_env: dict[str, str] = setting(
        {}, "environment variables for every rank.", templated=True, check="env_dict"
    )
    checkpoint_dir: str | None = setting(
        None,
        "the directory every rank finds in ``TORCHDIST_CHECKPOINT_DIR`` (``save_checkpoint`` / "
        "``load_latest_checkpoint``); the operator's default is "
        "``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>``, the same for every try. A local "
        "path or any fsspec URI (``s3://bucket/prefix``, ``gs://``, ``abfs://``, ``file:///``); see "
        "docs/checkpoints.md.",
        templated=True,
        check="checkpoint_dir",
    )
    checkpoint_conn_id: str | None = setting(
        None,
        "an Airflow connection whose credentials the ranks use for a remote ``checkpoint_dir`` "
        "(resolved on the worker into fsspec storage options, which reach the ranks in the 0600 "
        "``spec.json``); default: the executors' own (instance role, workload identity).",
        templated=True,
        check="optional_str",
    )
    resume_from: str | None = setting(
        None,
        'resume a checkpoint another DAG run wrote: ``"latest"`` (the newest in ``checkpoint_dir``) or '
        "one checkpoint's URI (from the ``checkpoints`` XCom). Default: a run resumes only its own "
        "checkpoints (an earlier try of the same DAG run's task), and says so in the log.",
        templated=True,
        check="resume_from",
    )
    checkpoint_keep_last: int = setting(
        2, "how many of the newest checkpoints of a task's DAG run are kept.", check="non_negative_int"
    )
    checkpoint_keep_best: int = setting(
        0,
        "how many of the best checkpoints by ``checkpoint_metric`` are kept besides the newest.",
        check="non_negative_int",
    )
    checkpoint_metric: str | None = setting(
        None,
        'the ``save_checkpoint(..., metrics={...})`` metric that ranks checkpoints (``"val_loss"``): '
        "``checkpoint_keep_best`` keeps the best by it and the ``checkpoints`` XCom lists them best first.",
        check="optional_str",
    )
    checkpoint_mode: str = setting(
        "min", '``"min"`` (lower is better) or ``"max"`` for ``checkpoint_metric``.', check="checkpoint_mode"
    )
    staging_dir: str | None = setting(
        None,
        "where per-run staging directories are created (default: the temp dir).",
        scope=SUBMIT,
        check="optional_str",
    )
    log_ranks: str | list[int] = setting(
        "all",
        'which global ranks\' stdout and stderr reach the task log: ``"all"``, a list of ranks, or '
        'a string such as ``"0,3"``. ``report()`` lines and a failing rank\'s traceback and last '
        "lines always show; the others' output goes to a per-run file the log names.",
        templated=True,
        check="log_ranks",
    )
    debug: bool = setting(
        False,
        "torchx's debug preset for every rank: ``CUDA_LAUNCH_BLOCKING=1``, ``NCCL_DESYNC_DEBUG=1``, "
        "``TORCH_DISTRIBUTED_DEBUG=DETAIL``, ``TORCH_SHOW_CPP_STACKTRACES=1``; ``rank_env`` wins over it.",
        templated=True,
        check="bool",
    )
    allow_unencrypted: bool = setting(
        False,
        "run even when ``spark.ssl.enabled=true``, accepting that torch's traffic (gloo/NCCL, the "
        "rendezvous store) and the run channel are not encrypted.",
        check="bool",
    )
    fast_jvm_start: bool = setting(
        True,
        "start the driver faster: a per-user class-data archive of Spark's classes and the C1 "
        "compiler only; on a local master, the executors' Python daemon imports the installed "
        "pyspark instead of compiling pyspark.zip. ``False``: Spark's own defaults.",
        scope=SUBMIT,
        check="bool",
    )
    output_path: str | None = setting(
        None,
        "where outputs bigger than ``max_xcom_output_bytes`` are stored (any ``ObjectStoragePath`` "
        "URI: ``s3://bucket/prefix``, ``file:///shared/dir``); XCom then holds a signed reference. "
        "Default: ``$AIRFLOW_HOME/torchdist-outputs`` on the worker.",
        templated=True,
        scope=XCOM,
        check="output_path",
    )
    max_xcom_output_bytes: int = setting(
        DEFAULT_MAX_XCOM_OUTPUT_BYTES,
        "largest encoded output carried inline in XCom (default 4 MiB).",
        scope=XCOM,
        check="non_negative_int",
    )
    durable: bool = setting(
        True,
        "keep training when the task process dies without being asked to (OOM, SIGKILL, a lost "
        "worker), and let the task's retry reattach to the run; ``False``: the run ends within 15 s "
        "of losing its task. An explicit kill (timeout, mark-failed, clear) always ends the run.",
        scope=OWNER,
        check="bool",
    )
    deferrable: bool | None = setting(
        None,
        "wait for the run in the triggerer, freeing the worker slot (default: ``[operators] "
        "default_deferrable``). The triggerer must reach the run's supervisor on the worker.",
        scope=OWNER,
        check="optional_bool",
    )
    reattach_timeout: float = setting(
        DEFAULT_REATTACH_TIMEOUT,
        "seconds a run without an owner (a killed task, a restarting triggerer) waits for one "
        "before it tears itself down; also how long a finished run keeps its result for a retry.",
        templated=True,
        scope=OWNER,
        check="float_timeout",
    )
    stop_grace_period: float = setting(
        DEFAULT_STOP_GRACE_PERIOD,
        "seconds the ranks get to checkpoint and return when the run is stopped (a timeout, "
        "``on_kill``, mark-failed or clear, the end of ``reattach_timeout``): they are sent "
        "``stop_signal`` and ``stop_requested()`` turns True; whatever still runs after it is killed. "
        "``0``: killed at once.",
        templated=True,
        check="grace_period",
    )
    stop_signal: str = setting(
        "SIGTERM",
        "the signal each rank gets when the run is stopped (``SIGTERM``, ``SIGINT``, ``SIGUSR1``, "
        "...); a rank without a handler of its own for it is not ended by it: "
        "``stop_requested()`` tells it to checkpoint and return.",
        templated=True,
        check="stop_signal",
    )
    hang_timeout: float | None = setting(
        DEFAULT_HANG_TIMEOUT,
        "seconds a rank may go without progress (a ``report()``, a ``stop_requested()``, a callback's "
        "step, or any move of its main thread in the Python code) before the run counts as hung: "
        "every rank's stacks reach the task log with the suspect ranks named, the run gets the "
        "graceful stop, and the task fails with ``TrainingHung``. At least 10; ``None`` or ``0``: "
        "no hang watchdog. See docs/hangs.md.",
        templated=True,
        check="hang_timeout",
    )
    openlineage_inject_parent_job_info: bool | None = setting(
        None,
        "with ``apache-airflow-providers-openlineage`` installed, give the Spark application this "
        "task try's OpenLineage identity, as ``SparkSubmitOperator`` does: ``spark.openlineage."
        "parentJobNamespace``, ``parentJobName``, ``parentRunId`` and the ``rootParent*`` ones, for "
        "the Spark OpenLineage listener; none is added when ``conf`` already sets one "
        "(default: ``[openlineage] spark_inject_parent_job_info``).",
        scope=LINEAGE,
        check="optional_bool",
    )
    openlineage_inject_transport_info: bool | None = setting(
        None,
        "the same for the OpenLineage provider's HTTP transport (``spark.openlineage.transport.*``, "
        "its API key included), so that the application sends its events where Airflow sends its "
        "own; none is added when ``conf`` already sets one "
        "(default: ``[openlineage] spark_inject_transport_info``).",
        scope=LINEAGE,
        check="optional_bool",
    )
    mlflow_conn_id: str | None = setting(
        None,
        "an ``mlflow`` connection (host: the tracking URI; login/password: basic auth; extra "
        "``token``: a bearer token): the task instance becomes one MLflow run with the run's "
        "``report()`` metrics, params and tags, continued by a retry; mapped instances are child "
        "runs of one parent. Needs ``airflow-provider-torchdist[mlflow]``. See docs/tracking.md "
        "(default: ``[torchdist] mlflow_conn_id``; empty: no tracking).",
        templated=True,
        scope=TRACKING,
        check="optional_str",
    )
    mlflow_log_model: bool = setting(
        False,
        "with ``mlflow_conn_id``: log rank 0's returned model (a ``torch.nn.Module`` or a state "
        "dict) as the MLflow run's model artifact ``model``; see docs/tracking.md.",
        scope=TRACKING,
        check="bool",
    )
    py_files: list[str] = setting(
        [],
        "``.py``, ``.zip`` or ``.egg`` files, or directories, put on every rank's ``sys.path`` "
        "(spark-submit's ``--py-files``): a directory holding ``__init__.py`` is zipped as that "
        "package, any other as a source root. ``spark_submit_kwargs['py_files']`` is merged in.",
        templated=True,
        scope=SUBMIT,
        check="str_list",
    )
    train_data: Any = setting(
        None,
        'Spark data for the ranks: a Spark SQL query (``"SELECT x, y FROM parquet.`/data/train`"``), a '
        "table name (``db.table``, read with ``spark.table``), or a callable ``fn(spark) -> DataFrame`` "
        "(cloudpickled, run by the driver). Each rank reads its shard with ``rank_shard()`` or "
        "``rank_batches()``.",
        templated=True,
        check="train_data",
    )
    train_data_args: dict[str, Any] = setting(
        {},
        "values for the ``:name`` parameters of a ``train_data`` query, bound by Spark "
        "(``spark.sql(query, args=...)``), never spliced into its text: "
        '``train_data="SELECT * FROM t WHERE day = :day"``, ``train_data_args={"day": "{{ ds }}"}``. '
        "Strings, numbers, booleans or None. Put anything from ``params`` or ``dag_run.conf`` here, "
        "not in the query.",
        templated=True,
        check="sql_args",
    )
    train_data_shuffle_seed: int | None = setting(
        None,
        "with ``train_data``: deal the rows to the ranks in a seeded order instead of the query's "
        "(the same shards on every retry); None: in order.",
        templated=True,
        check="optional_non_negative_int",
    )
    train_data_keep_remainder: bool = setting(
        False,
        "with ``train_data``: keep every row, the first ranks getting one more; default False: every "
        "rank gets the same number of rows (at most ``world_size - 1`` rows are dropped, and the log "
        "says how many), so that DDP does not hang on uneven inputs.",
        templated=True,
        check="bool",
    )
    spark_submit_kwargs: dict[str, Any] = setting(
        {},
        "other ``SparkSubmitHook`` settings: ``executor_memory``, ``driver_memory``, "
        "``executor_cores``, ``num_executors``, ``total_executor_cores``, ``name``, ``verbose``, "
        "``properties_file``, ``spark_binary``, ...",
        scope=SUBMIT,
        check="submit_kwargs",
    )

    @property
    def elastic(self) -> bool:
        """Whether ``num_processes`` is a ``"MIN:MAX"`` range (even ``"4:4"``)."""
        return isinstance(self.num_processes, str)

    @property
    def min_processes(self) -> int:
        """The fewest ranks the run may train with: MIN of a range, else ``num_processes``."""
        return (
            int(self.num_processes.split(":")[0])
            if isinstance(self.num_processes, str)
            else self.num_processes
        )

    @property
    def max_processes(self) -> int:
        """The most ranks the run may train with: MAX of a range, else ``num_processes``."""
        return (
            int(self.num_processes.split(":")[1])
            if isinstance(self.num_processes, str)
            else self.num_processes
        )

    @property
    def num_nodes(self) -> int:
        """How many torchrun agents (Spark tasks) the run submits: 1 in local mode, MAX's in an
        elastic run."""
        return 1 if self.local_mode else self.max_processes // self.nproc_per_node

    @property
    def min_nodes(self) -> int:
        """The fewest agents the run trains with: ``num_nodes`` unless the run is elastic."""
        return 1 if self.local_mode else self.min_processes // self.nproc_per_node

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingSpec:
        """A spec as :meth:`to_dict` wrote it (already validated: no checks here)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def for_cluster(self) -> TrainingSpec:
        """This spec less what only ``spark-submit`` needs (connection, Spark conf, environment):
        what travels to the driver and, inside the barrier tasks, to every executor."""
        return dataclasses.replace(
            self,
            conf={},
            env_vars={},
            spark_submit_kwargs={},
            conn_id=DEFAULT_CONN_ID,
            staging_dir=None,
            py_files=[],
            # A callable travels pickled in the staging directory (``DATA_FILE``), read by the driver.
            train_data=None if callable(self.train_data) else self.train_data,
        )


SETTINGS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(TrainingSpec)}


def settings_for(*scopes: str) -> list[str]:
    """The names of the settings of the given scopes, in declaration order."""
    return [name for name, f in SETTINGS.items() if f.metadata["scope"] in scopes]


def templated_settings() -> tuple[str, ...]:
    """The settings the operator templates."""
    return tuple(name for name, f in SETTINGS.items() if f.metadata["templated"])


def default_of(name: str) -> Any:
    f = SETTINGS[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


def signature_of(
    names: list[str], leading: list[inspect.Parameter], trailing: list[inspect.Parameter]
) -> inspect.Signature:
    """A signature with the given settings as keyword parameters, with their defaults."""
    params = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=default_of(name), annotation=SETTINGS[name].type
        )
        for name in names
    ]
    return inspect.Signature([*leading, *params, *trailing])


def param_docs(names: list[str]) -> str:
    """``:param name: doc`` lines for the given settings, for a generated docstring."""
    return "\n".join(f"    :param {name}: {SETTINGS[name].metadata['doc']}" for name in names)


def documented(names: list[str]) -> Callable[[type], type]:
    """Class decorator: append the settings' ``:param`` docs to the class docstring."""

    def apply(cls: type) -> type:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n" + param_docs(names) + "\n"
        return cls

    return apply
