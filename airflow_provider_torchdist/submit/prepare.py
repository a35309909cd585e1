"""What the hook does before any run starts: the checks that can fail first, the staged work, and
its plan.

:func:`check_and_stage` runs every check that can fail before anything starts
(:mod:`~airflow_provider_torchdist.submit.preflight`), then stages the work
(:mod:`~airflow_provider_torchdist.submit.staging`); :func:`plan_staged` turns the staged run into a
:class:`~airflow_provider_torchdist.submit.plan.SubmitPlan` and its fast JVM start. Between the
two the caller owns the staging directory (and removes it when planning fails).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from airflow_provider_torchdist.spark.connect.sessions import run_session_url
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.checkpoint_storage import checkpoint_rank_env
from airflow_provider_torchdist.submit.connect import check_connect_run
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.fast_start import plan_fast_start
from airflow_provider_torchdist.submit.local_cores import warn_at_run
from airflow_provider_torchdist.submit.plan import (
    SubmitPlan,
    build_plan,
    spark_home,
    spark_properties,
    submit_environment,
)
from airflow_provider_torchdist.submit.preflight import (
    check_checkpoint_dir,
    check_cluster_capacity,
    check_gpu_conf,
    check_master_reachable,
    check_spark_binary,
    check_torch_here,
)
from airflow_provider_torchdist.submit.py_files import check_module_importable, stage_py_files
from airflow_provider_torchdist.submit.staging import StagedRun, stage_run
from airflow_provider_torchdist.submit.validation import check_args


def check_and_stage(
    spec: TrainingSpec,
    target: SparkTarget,
    log: Any,
    train_object: Callable[..., Any] | str,
    args: list[Any] | tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
) -> tuple[StagedRun, dict[str, str], dict[str, str]]:
    """Every check that can fail before anything starts, then the staged work; returns the staged
    run, the Spark properties and spark-submit's environment (what :func:`plan_staged` takes)."""
    if target.is_connect:  # no spark-submit, no JVM here: the server's cluster runs the job
        check_connect_run(spec, target, train_object)
        props, env = {}, dict(spec.env_vars)
        slot_timeout = spec.slot_timeout
    else:
        environ = {**os.environ, **submit_environment(spec, target, {})}
        props = spark_properties(spec, target, spark_home(target, environ), environ)
        check_gpu_conf(spec, target, props)
        env = submit_environment(spec, target, props)
        check_spark_binary(target.spark_binary, {**os.environ, **env}.get("PATH"))
        check_master_reachable(target.master, spec.conn_id)
        slot_timeout = check_cluster_capacity(spec, target, log)
        warn_at_run(spec, target, log)  # every rank on this machine, more of them than its cores
    check_checkpoint_dir(spec.checkpoint_dir)
    # The directory, resume_from and retention; a remote store probed, its credentials (0600 spec.json).
    rank_env = {**spec.rank_env, **checkpoint_rank_env(spec)}
    staged = stage_run(
        train_object,
        check_args(args, "args", list),
        check_args(kwargs, "kwargs", dict),
        base_dir=spec.staging_dir,
        training=spec,
        slot_timeout=slot_timeout,
        rank_env=rank_env,
        master_web_ui=target.master_web_ui,
    )
    return staged, props, env


def plan_staged(
    spec: TrainingSpec, target: SparkTarget, staged: StagedRun, props: dict[str, str], env: dict[str, str]
) -> SubmitPlan:
    """The staged run's spark-submit plan, with its fast JVM start (the user's ``py_files`` staged too;
    a module-mode run that trains on this machine checked to be importable)."""
    user_py_files = stage_py_files(spec.py_files, staged.dir)
    other_python = {"PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON"} & set(spec.env_vars) or {
        "spark.pyspark.python",
        "spark.pyspark.driver.python",
    } & set(spec.conf)
    if (target.embedded or spec.local_mode) and not other_python:
        check_torch_here(
            "local mode trains on this machine"
            if spec.local_mode
            else "the embedded master's executors run here"
        )
        if staged.spec.kind == "module":
            check_module_importable(staged.spec.entry, user_py_files)
    fast = plan_fast_start(spec, target, {**os.environ, **env}, props)
    plan = build_plan(
        spec,
        target,
        application=str(staged.driver_path),
        application_args=[str(staged.spec_path)],
        files=staged.files,
        py_files=[staged.py_files, *user_py_files],
        properties={**props, **fast.conf},
        properties_dir=staged.dir,
        env={**env, **fast.env},
        jvm_archive=fast.jvm.pending_archive() if fast.jvm is not None else None,
    )
    if target.is_connect:  # a Connect session of the run's own, which its record can name
        url = run_session_url(plan.connection["url"])
        plan = dataclasses.replace(plan, connection={**plan.connection, "url": url})
    return plan
