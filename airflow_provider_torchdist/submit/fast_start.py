"""The start-up accelerations, behind one seam switched by ``fast_jvm_start``.

**The driver JVM's class-data archive and C1-only JIT** (:mod:`~airflow_provider_torchdist.submit.jvm`):
Spark's classes come memory-mapped and verified from a per-user archive the first run writes. It
saves about 2 s of each launch (``bench/launch.py --fast-start``; docs/benchmarks.md). spark-class's
own launcher JVM, which only prints the driver JVM's command line, gets C1 and the serial
collector (``SPARK_LAUNCHER_OPTS``, the user's own after ours).

**pyspark from its installed package in the executors' Python daemon** (a local master whose
executors run this interpreter: ``spark.python.daemon.module``,
:mod:`~airflow_provider_torchdist.spark.node.daemon`): Spark puts ``pyspark.zip`` first on the
daemon's path, and it compiles pyspark from sources on every start, 0.5 s before the first barrier
task. A user's own ``spark.python.daemon.module`` or ``spark.python.use.daemon=false`` wins.

**torch loaded in that daemon before it forks a barrier task's worker** (a distributed run on such
a master: ``spark.executorEnv.TORCHDIST_DAEMON_PRELOAD=1``): the daemon imports torch once, instead
of each barrier task importing it at the same time on the same cores (0.3 s of each launch).

An earlier acceleration was measured again and removed (``bench/launch.py --fast-start``, 5 rounds,
paired medians): ``SPARK_HOME`` for pip's ``spark-submit`` (-0.07 s, i.e. nothing). The driver's end
without interpreter teardown, removed with it then, is back for local mode only, where torch is
loaded in the driver and its teardown takes 0.4 s
(:func:`~airflow_provider_torchdist.spark.driver.finish.exit_without_teardown`).

``fast_jvm_start=False`` turns it off: Spark's own defaults. Nothing changes on YARN or Kubernetes,
where ``spark-submit``'s environment is not the driver's.

A benchmarking knob, not a setting: the environment variable ``TORCHDIST_FAST_START_OFF=jvm``,
``pyspark`` or ``torch`` (or ``all``; ``pyspark`` takes ``torch`` with it) switches one off in a run with ``fast_jvm_start`` on, so that ``bench/launch.py`` can measure
what it saves (:func:`~airflow_provider_torchdist.spark.wire.events.fast_start_off`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field

from airflow_provider_torchdist.spark.node.daemon import DAEMON_MODULE, PRELOAD_ENV
from airflow_provider_torchdist.spark.wire.events import fast_start_off
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.jvm import (
    C1_ONLY,
    DriverJvmStart,
    cache_root,
    file_fingerprint,
    java_binary,
    java_feature_version,
    java_fingerprint,
    merge_java_options,
    plan_driver_jvm_start,
)
from airflow_provider_torchdist.submit.jvm_cache import private_cache_dir

#: spark-class's launcher JVM (``SPARK_LAUNCHER_OPTS``): a few classes, run once, a small heap.
LAUNCHER_JVM_OPTIONS = (C1_ONLY, "-XX:+UseSerialGC")


def installed_spark_home(spark_binary: str, environ: Mapping[str, str]) -> str | None:
    """The installed pyspark's folder, when the ``spark-submit`` this run uses is pyspark's own.

    A connection with its own ``spark_binary``, or an environment with ``SPARK_HOME``, is left alone.
    """
    if environ.get("SPARK_HOME"):
        return None
    found = shutil.which(spark_binary, path=environ.get("PATH"))
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


@dataclass
class FastStart:
    """What a run's launch gets from the accelerations: environment, Spark settings, and a first
    run's archive."""

    env: dict[str, str]
    jvm: DriverJvmStart | None = None
    conf: dict[str, str] = field(default_factory=dict)


def plan_fast_start(
    spec: TrainingSpec, target: SparkTarget, environ: Mapping[str, str], properties: Mapping[str, str]
) -> FastStart:
    """The accelerations for one run, given spark-submit's environment and Spark settings."""
    if not spec.fast_jvm_start or target.is_yarn or target.is_kubernetes or target.is_connect:
        return FastStart({})
    full = dict(environ)
    off = fast_start_off(full)  # the benchmarking knob (module docstring)
    conf = {} if "pyspark" in off else installed_pyspark_daemon(target, full, properties)
    if conf and not spec.local_mode and "torch" not in off:
        # Its barrier tasks' workers start with torch loaded (spark/node/daemon.py). A local-mode run
        # trains on the driver, and its executors run only train_data's conversion: no torch there.
        conf[f"spark.executorEnv.{PRELOAD_ENV}"] = "1"
    if "jvm" in off:
        return FastStart({}, conf=conf)
    return FastStart(*_driver_jvm(spec, target, full, properties), conf=conf)


def installed_pyspark_daemon(
    target: SparkTarget, environ: Mapping[str, str], properties: Mapping[str, str]
) -> dict[str, str]:
    """``spark.python.daemon.module`` for executors that run this interpreter (a local master, no
    other Python named) and a daemon the user has not set up; otherwise nothing."""
    if not target.is_local or {"spark.pyspark.python", "spark.executorEnv.PYSPARK_PYTHON"} & set(properties):
        return {}
    if environ.get("PYSPARK_PYTHON", sys.executable) != sys.executable:
        return {}
    if "spark.python.daemon.module" in properties or properties.get("spark.python.use.daemon") == "false":
        return {}
    return {"spark.python.daemon.module": DAEMON_MODULE}


def _driver_jvm(
    spec: TrainingSpec, target: SparkTarget, full: dict[str, str], properties: Mapping[str, str]
) -> tuple[dict[str, str], DriverJvmStart]:
    """spark-submit's environment for the driver JVM's fast start, and its archive."""
    env: dict[str, str] = {}
    user_options = " ".join(
        filter(
            None,
            [
                full.get("JAVA_TOOL_OPTIONS"),
                full.get("SPARK_SUBMIT_OPTS"),
                properties.get("spark.driver.defaultJavaOptions"),
                properties.get("spark.driver.extraJavaOptions"),
            ],
        )
    )
    java = java_binary(full)
    spark = full.get("SPARK_HOME") or installed_spark_home(target.spark_binary, full)
    key_parts = [
        java_fingerprint(java),
        file_fingerprint(os.path.join(spark, "jars")) if spark else target.spark_binary,
        "local" if spec.local_mode else "distributed",
        user_options,
        str(spec.spark_submit_kwargs.get("driver_memory")),
    ]
    jvm = plan_driver_jvm_start(
        private_cache_dir(cache_root(full)),
        key_parts,
        user_options,
        java_feature_version(java),
        # On a local master the tasks that read train_data run in the driver JVM: C2 for them.
        c1_only=not (target.is_local and spec.train_data is not None),
    )
    env["SPARK_SUBMIT_OPTS"] = jvm.spark_submit_opts(full.get("SPARK_SUBMIT_OPTS"))
    # spark-class's own JVM, which only prints the driver JVM's command line: 0.18 s -> 0.14 s.
    env["SPARK_LAUNCHER_OPTS"] = merge_java_options(LAUNCHER_JVM_OPTIONS, full.get("SPARK_LAUNCHER_OPTS"))
    return env, jvm
