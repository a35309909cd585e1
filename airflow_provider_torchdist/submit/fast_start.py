"""The start-up acceleration, behind one seam switched by ``fast_jvm_start``.

**The driver JVM's class-data archive and C1-only JIT** (:mod:`~airflow_provider_torchdist.submit.jvm`):
Spark's classes come memory-mapped and verified from a per-user archive the first run writes. It
saves about 2 s of each launch (``bench/launch.py --fast-start``; docs/benchmarks.md).

Two earlier accelerations were measured again and removed, each saving less than the 0.5 s that
justifies a trick on the main path (``bench/launch.py --fast-start``, 5 rounds, paired medians):
``SPARK_HOME`` for pip's ``spark-submit`` (-0.07 s, i.e. nothing) and the driver's ``os._exit``
without interpreter teardown (-0.35 s, within the spread).

``fast_jvm_start=False`` turns it off: Spark's own defaults. Nothing changes on YARN or Kubernetes,
where ``spark-submit``'s environment is not the driver's.

A benchmarking knob, not a setting: the environment variable ``TORCHDIST_FAST_START_OFF=jvm`` (or
``all``) switches it off in a run with ``fast_jvm_start`` on, so that ``bench/launch.py`` can measure
what it saves (:func:`~airflow_provider_torchdist.spark.wire.events.fast_start_off`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass

from airflow_provider_torchdist.spark.wire.events import fast_start_off
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.jvm import (
    DriverJvmStart,
    cache_root,
    file_fingerprint,
    java_binary,
    java_feature_version,
    java_fingerprint,
    plan_driver_jvm_start,
    private_cache_dir,
)


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
    """What a run's launch gets from the accelerations: environment, and a first run's archive."""

    env: dict[str, str]
    jvm: DriverJvmStart | None = None

    def finish(self) -> None:
        """After spark-submit ended: install a first run's class-data archive into the cache."""
        if self.jvm is not None:
            self.jvm.finish()


def plan_fast_start(
    spec: TrainingSpec, target: SparkTarget, environ: Mapping[str, str], properties: Mapping[str, str]
) -> FastStart:
    """The accelerations for one run, given spark-submit's environment and Spark settings."""
    if not spec.fast_jvm_start or target.is_yarn or target.is_kubernetes or target.is_connect:
        return FastStart({})
    env: dict[str, str] = {}
    full = dict(environ)
    if "jvm" in fast_start_off(full):  # the benchmarking knob (module docstring)
        return FastStart(env)
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
    return FastStart(env, jvm)
