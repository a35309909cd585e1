"""A run's ``spark-submit``, as a plain plan.

:func:`build_plan` turns a spec, its resolved target and its staged files into a
:class:`SubmitPlan`: the application, its files, every Spark setting, the environment, the
connection. Everything is resolved here, in the task; the plan is plain data (``to_json``) that
another process can run: :class:`~airflow_provider_torchdist.submit.spark_submit.Submission` runs it
through the Spark provider's hook.

Spark settings never go on a command line: they are written to a 0600 properties file in the
run's private staging directory (:mod:`~airflow_provider_torchdist.submit.properties`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import secrets
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.fast_start import installed_spark_home
from airflow_provider_torchdist.submit.masking import mask_setting_secrets
from airflow_provider_torchdist.submit.properties import (
    read_properties,
    spark_defaults_file,
)

#: The run's Spark settings, in its staging directory (0600): never on a command line.
SPARK_PROPERTIES_FILE = "spark-conf.properties"
APP_NAME = "torchdist"
# Defaults for our own application; anything the user puts in ``conf`` wins.
APP_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
    # Spark's own check for a barrier stage too big for the cluster retries 40 times, 15 s apart;
    # the driver checks first (slot_timeout), this is the backstop.
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "20",
}
#: Settings by which the user gives Spark the secret for ``spark.authenticate`` themselves.
_AUTH_SECRET_KEYS = (
    "spark.authenticate.secret",
    "spark.authenticate.secret.file",
    "spark.authenticate.secret.driver.file",
)
#: ``SparkSubmitHook`` arguments the plan sets itself; ``spark_submit_kwargs`` may give the others.
_PLANNED = {"conf", "conn_id", "files", "py_files", "application_args", "env_vars", "properties_file"}


def submit_hook_arguments() -> set[str]:
    """The public keyword arguments of ``SparkSubmitHook``'s constructor that a user may set."""
    return set(inspect.signature(SparkSubmitHook.__init__).parameters) - {"self"} - _PLANNED


@dataclass(frozen=True)
class SubmitPlan:
    """Everything one ``spark-submit`` needs, resolved (see the module docstring)."""

    application: str
    application_args: list[str]
    #: The Spark connection in Airflow's JSON form (``conn_type`` ``spark``).
    connection: dict[str, Any]
    #: Every Spark setting; written to ``properties_file`` (0600), never passed on a command line.
    properties: dict[str, str]
    properties_file: str
    files: list[str]
    py_files: list[str]
    #: spark-submit's environment on top of the current one.
    env: dict[str, str]
    #: Other ``SparkSubmitHook`` arguments (``executor_memory``, ``name``, ``verbose``, ...).
    submit_kwargs: dict[str, Any]
    #: A first run's JVM class-data archive, installed when spark-submit ends
    #: (:meth:`~airflow_provider_torchdist.submit.jvm.DriverJvmStart.pending_archive`).
    jvm_archive: dict[str, str] | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SubmitPlan:
        return cls(**json.loads(text))


def topology_conf(spec: TrainingSpec) -> dict[str, str]:
    """One task per slot: each task runs ``nproc_per_node`` ranks, so it takes that many CPUs (or
    GPUs), and Spark places no two such tasks on a slot meant for one. An elastic run also gets
    the task retries that bring its lost nodes back (:func:`elastic_conf`)."""
    if spec.local_mode:
        return {}
    if spec.use_gpu:
        conf = {"spark.task.resource.gpu.amount": str(spec.nproc_per_node)}
    else:
        # On a shared standalone cluster an application takes every free core unless capped, which
        # would starve the next run; take exactly what the stage needs at its largest (MAX).
        conf = {"spark.task.cpus": str(spec.nproc_per_node), "spark.cores.max": str(spec.max_processes)}
    return conf | elastic_conf(spec)


def elastic_conf(spec: TrainingSpec) -> dict[str, str]:
    """``spark.task.maxFailures`` for an elastic run: ``max_restarts + 2`` attempts per task.

    An elastic run's stage is an ordinary one, and a lost node comes back only as Spark's retry of
    its task; Spark's default (4 attempts) would end the job after the fourth loss of one node
    however many restarts ``max_restarts`` allows. Each loss the run may survive costs one restart,
    so a task needs its first attempt, one per restart, and one to spare (a retry that lands on a
    host going down too) for Spark never to give up before torchrun's agents do: the run's own
    bound stays ``max_restarts``. ``conf`` (the user's, or the connection's) wins, as it is merged
    over this.
    """
    if not spec.elastic:
        return {}
    return {"spark.task.maxFailures": str(spec.max_restarts + 2)}


def spark_properties(
    spec: TrainingSpec, target: SparkTarget, spark_home: str | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """What spark-submit would have read, merged as it merges it, lowest precedence first:
    ``spark-defaults.conf`` (only without a ``properties_file``, as spark-submit skips it then), the
    user's ``properties_file``, then our defaults and ``conf``; on YARN and Kubernetes ``env_vars``
    as the remote driver's environment; on the embedded master, Spark's own authentication with a
    secret for this run only, unless the settings already decide it."""
    user_file = spec.spark_submit_kwargs.get("properties_file")
    source = user_file or spark_defaults_file(environ, spark_home)
    props: dict[str, str] = {}
    if source:
        try:
            props.update(read_properties(source))
        except (OSError, ValueError) as exc:
            what = "properties_file" if user_file else "Spark's defaults file"
            raise InvalidTrainingConfig(
                f"Cannot read the {what} {str(source)!r}: {exc}. spark-submit reads it as a Java "
                "properties file (UTF-8; key=value, key: value or key value lines)."
            ) from None
    props.update(topology_conf(spec))
    props.update(APP_CONF)
    props.update(target.conf)
    props.update({str(k): str(v) for k, v in spec.conf.items()})
    if target.is_yarn or target.is_kubernetes:  # env_vars are the remote driver's there
        prefix = "spark.yarn.appMasterEnv." if target.is_yarn else "spark.kubernetes.driverEnv."
        props.update({prefix + k: str(v) for k, v in spec.env_vars.items()})
    props.update(embedded_authentication(target, props))
    mask_setting_secrets(props)
    return props


def embedded_authentication(target: SparkTarget, props: Mapping[str, str]) -> dict[str, str]:
    """On the embedded master, ``spark.authenticate`` with a random secret for this run: other
    users of this machine then cannot talk to the driver's RPC, block or file servers on
    127.0.0.1 (and fetch the task closures). Left alone when the settings turn it off or bring their
    own secret."""
    if not target.embedded:
        return {}
    auth = props.get("spark.authenticate")
    if auth is not None and auth.strip().lower() != "true":
        return {}
    if any(props.get(key) for key in _AUTH_SECRET_KEYS):
        return {}
    secret = secrets.token_urlsafe(32)
    mask_setting_secrets({"spark.authenticate.secret": secret})
    return {"spark.authenticate": auth or "true", "spark.authenticate.secret": secret}


def spark_home(target: SparkTarget, environ: Mapping[str, str]) -> str | None:
    """The Spark home spark-submit will run from (where its ``conf/spark-defaults.conf`` is):
    ``SPARK_HOME``, else pyspark's own folder, else the folder around the ``bin/spark-submit`` it
    resolves to."""
    if environ.get("SPARK_HOME"):
        return environ["SPARK_HOME"]
    home = installed_spark_home(target.spark_binary, environ)
    if home:
        return home
    found = shutil.which(target.spark_binary, path=environ.get("PATH"))
    real = Path(os.path.realpath(found)) if found else None
    return str(real.parent.parent) if real and real.parent.name == "bin" else None


def submit_environment(spec: TrainingSpec, target: SparkTarget, props: Mapping[str, str]) -> dict[str, str]:
    """spark-submit's environment: the Python that runs Airflow runs the driver and executors;
    ``env_vars`` win (on YARN and Kubernetes they went to the remote driver instead)."""
    bin_dir = sysconfig.get_path("scripts")
    env = {
        # spark-submit may not be on PATH when Airflow runs from an unactivated virtualenv.
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
    }
    if "spark.pyspark.python" not in props:
        env["PYSPARK_PYTHON"] = os.environ.get("PYSPARK_PYTHON", sys.executable)
    if target.embedded:
        env["SPARK_LOCAL_IP"] = target.conf["spark.driver.host"]
    user = {k: str(v) for k, v in spec.env_vars.items()}
    if target.is_kubernetes:  # they are the remote driver's only (spark.kubernetes.driverEnv.*)
        return {}
    if target.is_yarn:  # spark-submit's too (HADOOP_CONF_DIR, ...), as SparkSubmitHook gives them
        return user
    return {**env, **user}


def build_plan(
    spec: TrainingSpec,
    target: SparkTarget,
    *,
    application: str,
    application_args: list[str],
    files: list[str],
    py_files: list[str],
    properties: Mapping[str, str],
    properties_dir: Path,
    env: Mapping[str, str],
    jvm_archive: dict[str, str] | None = None,
) -> SubmitPlan:
    """The plan of one run; ``properties`` and ``env`` from :func:`spark_properties` and
    :func:`submit_environment` (plus the fast-start environment)."""
    kwargs = {k: v for k, v in spec.spark_submit_kwargs.items() if k != "properties_file"}
    kwargs.setdefault("name", APP_NAME)
    if target.spark_binary:
        kwargs["spark_binary"] = target.spark_binary
    return SubmitPlan(
        application=application,
        application_args=list(application_args),
        connection=dict(target.connection),
        properties=dict(properties),
        properties_file=str(properties_dir / SPARK_PROPERTIES_FILE),
        files=list(files),
        py_files=list(py_files),
        env=dict(env),
        submit_kwargs=kwargs,
        jvm_archive=jvm_archive,
    )
