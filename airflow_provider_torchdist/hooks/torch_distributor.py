"""TorchDistributorHook: connection, packaging, spark-submit and the result fetch."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import cloudpickle
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.providers.common.compat.sdk import AirflowException, AirflowNotFoundException, mask_secret

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed, TrainingFailed
from airflow_provider_torchdist.jvm import (
    DriverJvmStart,
    cache_root,
    file_fingerprint,
    java_binary,
    java_feature_version,
    java_fingerprint,
    plan_driver_jvm_start,
    private_cache_dir,
)
from airflow_provider_torchdist.preflight import check_local_gpus, check_master_reachable, check_spark_binary
from airflow_provider_torchdist.spark.checkpoints import CHECKPOINT_ENV
from airflow_provider_torchdist.spark.outcome import Outcome
from airflow_provider_torchdist.staging import StagedRun, stage_run
from airflow_provider_torchdist.validation import (
    check_args,
    check_bool,
    check_deploy_mode,
    check_int,
    check_topology,
    check_unencrypted_allowed,
)

T = TypeVar("T")

DEFAULT_CONN_ID = "spark_default"
#: This provider's connection type: a ``spark`` connection whose form also shows ``master-web-ui``.
CONN_TYPE = "torchdist_spark"
#: Connection extra with the standalone master's web UI, e.g. ``http://spark-master:8080``: with it the
#: hook checks before submitting that the cluster can ever fit the job.
MASTER_WEB_UI_EXTRA = "master-web-ui"
_SECRET_NAME = re.compile(
    r"secret|password|passwd|token|credential|private|api[_.-]?key|access[_.-]?key", re.I
)
_APPLICATION_LINE = re.compile(r"\[torchdist\] application (?P<app>\S+) spark-ui (?P<ui>\S+)")
EMBEDDED_HOST = "127.0.0.1"

# Defaults for our own application; anything the user puts in ``conf`` wins.
_APP_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
    # Spark's own check for a barrier stage too big for the cluster retries 40 times, 15 s apart;
    # the driver checks first (slot_timeout), this is the backstop.
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "20",
}


def session_members(sid: int) -> list[int]:
    """PIDs of the live processes in session ``sid`` (Linux ``/proc``), zombies excluded."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                # The fields after the parenthesised command: state, ppid, pgrp, session, ...
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":
            members.append(int(entry))
    return members


class TorchDistributorHook(SparkSubmitHook):
    """Run a PyTorch training callable or script on Spark and return rank 0's value.

    Semantics follow PySpark's ``TorchDistributor``. A callable runs as ``fn(*args, **kwargs)`` on
    every rank; a script path runs like ``torchrun script.py *args``. With no Spark connection
    configured, the run goes to an embedded ``local[N]`` master on this machine.

    Example::

        hook = TorchDistributorHook(num_processes=2, local_mode=False, use_gpu=False)
        result = hook.run(train_fn, 1e-3, epochs=3)   # rank 0's return value

    :param num_processes: total number of ranks (the world size).
    :param local_mode: run the ranks on the Spark driver instead of in a barrier stage.
    :param use_gpu: give each rank the GPU(s) Spark assigned to its task and use NCCL.
    :param nproc_per_node: ranks per Spark task (distributed mode); ``num_processes`` must divide.
    :param max_restarts: how often torchrun's agent restarts the worker group after a failure.
    :param rendezvous_timeout: seconds the ranks may take to find each other.
    :param socket_ifname: network interface for gloo/NCCL; default: the one carrying the task's address.
    :param conn_id: the Spark connection; ``spark_default`` falls back to the embedded master.
    :param conf: Spark configuration properties.
    :param rank_env: environment variables for every rank.
    :param staging_dir: where per-run staging directories are created (default: the temp dir).
    :param checkpoint_dir: a directory every rank finds in ``TORCHDIST_CHECKPOINT_DIR`` (for
        ``save_checkpoint`` / ``load_latest_checkpoint``); created if it is a local path.
    :param allow_unencrypted: run even when ``spark.ssl.enabled=true``, accepting that torch's own
        traffic (gloo/NCCL, the rendezvous store) and the run channel are not encrypted.
    :param fast_jvm_start: start the driver JVM with a per-user class-data archive of Spark's
        classes (written by the first run, kept under ``~/.cache/airflow-provider-torchdist``) and
        with the C1 compiler only; about 2 to 3 s less per run. ``False``: Spark's own JVM defaults.
    :param spark_submit_kwargs: any other :class:`SparkSubmitHook` argument (``executor_memory``,
        ``driver_memory``, ``executor_cores``, ``env_vars``, ``name``, ...).
    """

    hook_name = "PyTorch on Spark"
    conn_type = CONN_TYPE

    @classmethod
    def get_connection(cls, conn_id: str) -> Any:
        """The connection, with a ``torchdist_spark`` one read as the ``spark`` one it mirrors: the
        Spark provider builds the master URL (``spark://host:port``, ``yarn``, ``k8s://...``) only for
        connections of type ``spark``."""
        conn = super().get_connection(conn_id)
        if conn.conn_type == CONN_TYPE:
            conn.conn_type = "spark"
        return conn

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = False,
        use_gpu: bool = False,
        *,
        nproc_per_node: int = 1,
        max_restarts: int = 0,
        rendezvous_timeout: int = 300,
        slot_timeout: float = 20.0,
        socket_ifname: str | None = None,
        conn_id: str = DEFAULT_CONN_ID,
        conf: dict[str, Any] | None = None,
        rank_env: dict[str, str] | None = None,
        staging_dir: str | None = None,
        allow_unencrypted: bool = False,
        checkpoint_dir: str | None = None,
        fast_jvm_start: bool = True,
        **spark_submit_kwargs: Any,
    ) -> None:
        self.num_processes, self.nproc_per_node, self.local_mode = check_topology(
            num_processes, nproc_per_node, local_mode
        )
        self.use_gpu = check_bool(use_gpu, "use_gpu")
        self.max_restarts = check_int(max_restarts, "max_restarts", minimum=0)
        self.rendezvous_timeout = check_int(rendezvous_timeout, "rendezvous_timeout")
        self.slot_timeout = float(slot_timeout)
        self.socket_ifname = socket_ifname
        self.rank_env = {str(k): str(v) for k, v in (rank_env or {}).items()}
        self.checkpoint_dir = checkpoint_dir
        if checkpoint_dir:
            self.rank_env[CHECKPOINT_ENV] = str(checkpoint_dir)
        self.staging_dir = staging_dir
        self.allow_unencrypted = check_bool(allow_unencrypted, "allow_unencrypted")
        self.fast_jvm_start = check_bool(fast_jvm_start, "fast_jvm_start")
        for name, value in {
            **(conf or {}),
            **(rank_env or {}),
            **(spark_submit_kwargs.get("env_vars") or {}),
        }.items():
            if _SECRET_NAME.search(str(name)):
                mask_secret(str(value))  # Airflow then redacts it from every log line and error
        self.embedded = False
        self.master_web_ui: str | None = None
        #: Called with (application id, Spark UI URL or None, master's application page or None) as
        #: soon as the driver reports them; the operator pushes them to XCom for the extra links.
        self.on_application: Callable[[str, str | None, str | None], None] | None = None
        self.application_id: str | None = None
        self._staged: StagedRun | None = None
        #: What the last run's training code reported with ``report()``, in order.
        self.metrics: list[dict[str, Any]] = []
        spark_submit_kwargs.setdefault("name", "torchdist")
        super().__init__(
            conf={**self._topology_conf(), **_APP_CONF, **(conf or {})},
            conn_id=conn_id,
            **spark_submit_kwargs,
        )
        check_deploy_mode(self._connection["deploy_mode"])
        if not (self._is_yarn or self._is_kubernetes):  # there env_vars become the remote driver's
            self._env_vars = {**self._default_env(), **(self._env_vars or {})}
        #: spark-submit's environment as configured; each run adds its launch settings to a copy.
        self._configured_env = self._env_vars

    # -- connection ---------------------------------------------------------------------------

    @property
    def slots_needed(self) -> int:
        """Spark task slots the barrier stage needs (1 in local mode: the driver does the work)."""
        return 1 if self.local_mode else self.num_processes // self.nproc_per_node

    def _topology_conf(self) -> dict[str, str]:
        """One barrier task per slot: each task runs ``nproc_per_node`` ranks, so it takes that many
        CPUs (or GPUs), and Spark places no two such tasks on a slot meant for one."""
        if self.local_mode:
            return {}
        if self.use_gpu:
            return {"spark.task.resource.gpu.amount": str(self.nproc_per_node)}
        # On a shared standalone cluster an application takes every free core unless capped, which
        # would starve the next run; take exactly what the barrier stage needs.
        return {
            "spark.task.cpus": str(self.nproc_per_node),
            "spark.cores.max": str(self.num_processes),
        }

    def _resolve_connection(self) -> dict[str, Any]:
        try:
            conn = self.get_connection(self._conn_id)
            self.master_web_ui = conn.extra_dejson.get(MASTER_WEB_UI_EXTRA)
        except AirflowNotFoundException:
            if self._conn_id != DEFAULT_CONN_ID:
                raise InvalidTrainingConfig(
                    f"Spark connection {self._conn_id!r} is not defined. Create it (Admin > Connections, "
                    f"or AIRFLOW_CONN_{self._conn_id.upper()}='spark://host:7077'), or leave conn_id unset "
                    "to run on the embedded local Spark master."
                ) from None
            return self._embedded_connection()
        return super()._resolve_connection()

    def _embedded_connection(self) -> dict[str, Any]:
        self.embedded = True
        master = f"local[{self.num_processes if not self.local_mode else 1}]"
        self.log.info(
            "No Spark connection %r is configured: running on an embedded local Spark master %s on %s. "
            "Create a 'spark' connection to use a cluster.",
            self._conn_id,
            master,
            EMBEDDED_HOST,
        )
        # Keep the driver's servers (RPC, block manager, UI) on loopback.
        for key in ("spark.driver.host", "spark.driver.bindAddress"):
            self._conf.setdefault(key, EMBEDDED_HOST)
        return {
            "master": master,
            "queue": None,
            "deploy_mode": None,
            "spark_binary": self.spark_binary or "spark-submit",
            "namespace": None,
            "principal": self._principal,
            "keytab": self._keytab,
            "rest_scheme": "http",
            "rest_port": 6066,
            "rest_endpoint": None,
        }

    def _default_env(self) -> dict[str, str]:
        """spark-submit's environment: the Python that runs Airflow runs the driver and executors."""
        bin_dir = sysconfig.get_path("scripts")
        env = {
            # spark-submit may not be on PATH when Airflow runs from an unactivated virtualenv.
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
        }
        if "spark.pyspark.python" not in self._conf:
            env["PYSPARK_PYTHON"] = os.environ.get("PYSPARK_PYTHON", sys.executable)
        if self.embedded:
            env["SPARK_LOCAL_IP"] = EMBEDDED_HOST
        return env

    def _installed_spark_home(self, environ: dict[str, str]) -> str | None:
        """The installed pyspark's folder, when the spark-submit this run uses is pyspark's own.

        pip's ``spark-submit`` finds its Spark home with ``find_spark_home.py``, a Python start of
        its own (about 0.9 s of each launch); with ``SPARK_HOME`` set it skips that. A connection
        with its own ``spark_binary``, or an environment with ``SPARK_HOME``, is left alone.
        """
        if environ.get("SPARK_HOME"):
            return None
        found = shutil.which(self._connection["spark_binary"] or "", path=environ.get("PATH"))
        spec = importlib.util.find_spec("pyspark")
        if not found or spec is None or not spec.submodule_search_locations:
            return None
        home = os.path.realpath(list(spec.submodule_search_locations)[0])
        ours = {
            os.path.realpath(os.path.join(sysconfig.get_path("scripts"), "spark-submit")),
            os.path.join(home, "bin", "spark-submit"),
        }
        if os.path.realpath(found) in ours and os.path.isdir(os.path.join(home, "jars")):
            return home
        return None

    def _launch_env(self) -> DriverJvmStart | None:
        """Set this run's spark-submit environment: ``SPARK_HOME`` and the driver JVM's start options.

        Returns the JVM plan, whose ``finish()`` installs a first run's class-data archive. Nothing
        changes on YARN or Kubernetes, where ``env_vars`` go to the remote driver.
        """
        if self._is_yarn or self._is_kubernetes:
            return None
        env = dict(self._configured_env or {})
        full = {**os.environ, **env}
        spark_home = self._installed_spark_home(full)
        if spark_home:
            env["SPARK_HOME"] = full["SPARK_HOME"] = spark_home
        start = None
        if self.fast_jvm_start:
            user_options = " ".join(
                filter(
                    None,
                    [
                        full.get("JAVA_TOOL_OPTIONS"),
                        full.get("SPARK_SUBMIT_OPTS"),
                        self._conf.get("spark.driver.defaultJavaOptions"),
                        self._conf.get("spark.driver.extraJavaOptions"),
                    ],
                )
            )
            java = java_binary(full)
            spark = full.get("SPARK_HOME")
            key_parts = [
                java_fingerprint(java),
                file_fingerprint(os.path.join(spark, "jars")) if spark else self._connection["spark_binary"],
                "local" if self.local_mode else "distributed",
                user_options,
                str(self._driver_memory),
            ]
            start = plan_driver_jvm_start(
                private_cache_dir(cache_root(full)), key_parts, user_options, java_feature_version(java)
            )
            env["SPARK_SUBMIT_OPTS"] = start.spark_submit_opts(full.get("SPARK_SUBMIT_OPTS"))
        self._env_vars = env
        return start

    # -- running ------------------------------------------------------------------------------

    def check_transport_security(self) -> None:
        """Refuse to mix an encrypted Spark cluster with torch's unencrypted traffic unless told to."""
        check_unencrypted_allowed(self._conf, self.allow_unencrypted)

    def check_submit_environment(self) -> None:
        """spark-submit exists where it will run, and a standalone master answers: else fail now,
        clearly, instead of a ``FileNotFoundError`` or a minute of Spark's retries."""
        path = {**os.environ, **(self._env_vars or {})}.get("PATH")
        check_spark_binary(self._connection["spark_binary"] or "spark-submit", path)
        check_master_reachable(self._connection["master"], self._conn_id)

    def check_gpu_conf(self) -> None:
        """``use_gpu`` needs Spark to schedule GPUs to the barrier tasks; say how when it does not."""
        if not self.use_gpu:
            return
        if self.local_mode:  # client mode: the ranks run on this machine
            check_local_gpus(self.num_processes)
            return
        if self._connection["master"].startswith("local"):
            raise InvalidTrainingConfig(
                f"use_gpu=True in distributed mode needs a cluster: Spark's {self._connection['master']} "
                "master cannot assign GPUs to tasks (its tasks would wait forever). Use local_mode=True "
                "to run the ranks on the driver's GPUs, or a Spark connection to a GPU cluster."
            )
        if not self._conf.get("spark.executor.resource.gpu.amount"):
            raise InvalidTrainingConfig(
                "use_gpu=True needs Spark to assign GPUs to tasks: set conf "
                "spark.executor.resource.gpu.amount (GPUs per executor) and, for standalone clusters, "
                "spark.executor.resource.gpu.discoveryScript (spark.task.resource.gpu.amount defaults to "
                f"nproc_per_node={self.nproc_per_node}). Or run with use_gpu=False."
            )

    def check_cluster_capacity(self) -> float | None:
        """With the master's web UI known, fail before submitting when the cluster can never fit the job.

        Returns the driver's slot timeout: None (wait as long as it takes, saying so in the log) when
        the cluster can fit the stage once other work ends, ``slot_timeout`` when capacity is unknown.
        """
        if self.local_mode or not self.master_web_ui:
            return self.slot_timeout
        import requests

        try:
            state = requests.get(self.master_web_ui.rstrip("/") + "/json/", timeout=5).json()
        except (requests.RequestException, ValueError) as exc:
            self.log.warning("Could not read the Spark master's state at %s: %s", self.master_web_ui, exc)
            return self.slot_timeout
        workers = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
        if self.use_gpu:
            per_worker = [
                len((w.get("resources") or {}).get("gpu", {}).get("addresses", [])) for w in workers
            ]
        else:
            per_worker = [int(w.get("cores", 0)) for w in workers]
        slots = sum(n // self.nproc_per_node for n in per_worker)
        if slots < self.slots_needed:
            unit = "GPUs" if self.use_gpu else "cores"
            raise InvalidTrainingConfig(
                f"The barrier stage needs {self.slots_needed} task slot(s) of {self.nproc_per_node} {unit} "
                f"each at once, but the cluster at {self._connection['master']} can never offer more than "
                f"{slots} ({len(workers)} alive worker(s) with {unit} {per_worker}). Lower num_processes, "
                "change nproc_per_node, or add workers."
            )
        return None

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Train, and return global rank 0's return value (None for a script).

        Raises :class:`TrainingFailed` naming each failed rank, its host and its exception.
        """
        pickled = self.run_pickled(train_object, list(args), kwargs)
        return None if pickled is None else cloudpickle.loads(pickled)

    def run_pickled(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> bytes | None:
        """Like :meth:`run`, but return rank 0's value still pickled."""
        return self.run_to_path(train_object, args, kwargs, lambda path: path.read_bytes() if path else None)

    def run_to_path(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
        handle: Callable[[Path | None], T],
    ) -> T:
        """Train, then hand ``handle`` the file holding rank 0's pickled value (None for a script)
        before the staging directory goes: large outputs are streamed on, never loaded whole."""
        self.check_transport_security()
        self.check_gpu_conf()
        self.check_submit_environment()
        if self.checkpoint_dir and "://" not in self.checkpoint_dir:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
        slot_timeout = self.check_cluster_capacity()
        staged = stage_run(
            train_object,
            check_args(args, "args", list),
            check_args(kwargs, "kwargs", dict),
            base_dir=self.staging_dir,
            num_processes=self.num_processes,
            local_mode=self.local_mode,
            use_gpu=self.use_gpu,
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            rendezvous_timeout=self.rendezvous_timeout,
            slot_timeout=slot_timeout,
            socket_ifname=self.socket_ifname,
            rank_env=self.rank_env,
        )
        self._staged = staged
        try:
            self._submit_staged(staged)
            return handle(None if staged.spec.kind == "script" else staged.output_path)
        finally:
            self._stop_process_group()
            staged.cleanup()
            self._staged = None

    def _submit_staged(self, staged: StagedRun) -> None:
        self._files = ",".join(staged.files)
        self._py_files = staged.py_files
        self._application_args = [str(staged.spec_path)]
        submit_error: AirflowException | None = None
        jvm_start = self._launch_env()
        try:
            # A session of its own, so a kill reaches the driver and every local rank too.
            self.submit(application=str(staged.driver_path), start_new_session=True)
        except AirflowException as exc:
            submit_error = exc
        finally:
            if jvm_start is not None:
                jvm_start.finish()
        outcome = Outcome.read(staged.dir)
        self.metrics = outcome.metrics if outcome else []
        if outcome is None:
            raise SparkSubmitFailed(
                f"The Spark application ended before the training driver reported an outcome: {submit_error}"
            ) from submit_error
        if not outcome.ok:
            raise TrainingFailed(outcome.failures, outcome.error)
        if staged.spec.kind == "callable" and not staged.output_path.exists():
            raise SparkSubmitFailed("Training succeeded but rank 0's return value never reached the driver.")

    def _process_spark_submit_log(self, itr: Iterator[Any]) -> None:
        super()._process_spark_submit_log(self._watch_application(itr))

    def _watch_application(self, itr: Iterator[Any]) -> Iterator[Any]:
        """Pass spark-submit's lines on, noting the driver's ``application <id> spark-ui <url>`` line."""
        for line in itr:
            match = _APPLICATION_LINE.search(line)
            if match and self.application_id is None:
                self.application_id = match["app"]
                ui = None if match["ui"] == "-" else match["ui"]
                master_page = (
                    f"{self.master_web_ui.rstrip('/')}/app/?appId={self.application_id}"
                    if self.master_web_ui
                    else None
                )
                if self.on_application:
                    self.on_application(self.application_id, ui, master_page)
            yield line

    # -- stopping -----------------------------------------------------------------------------

    def _stop_process_group(self, grace: float = 5.0) -> None:
        """End whatever is left of spark-submit's session: JVM, Python driver, Spark's Python daemon
        and workers (which move to process groups of their own, but stay in the session), local ranks."""
        proc = self._submit_sp
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            members = session_members(proc.pid)
            if not members:
                return
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while session_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_kill(self) -> None:
        """Stop the Spark application and every process of the run (Airflow's kill or timeout)."""
        super().on_kill()
        self._stop_process_group()
        if self._staged is not None:
            self._staged.cleanup()
