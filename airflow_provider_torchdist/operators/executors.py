"""What the deployment's executor means for a run: where its task runs, and whether it may defer."""

from __future__ import annotations

from typing import Any

from airflow.providers.common.compat.sdk import conf as airflow_conf

from airflow_provider_torchdist.errors import InvalidTrainingConfig

#: Executors that run each task in a container of its own, which ends with the task.
POD_BOUND = ("KubernetesExecutor", "AwsEcsExecutor", "AwsBatchExecutor", "AwsLambdaExecutor")


def task_executor(ti: Any) -> str:
    """The executor ``ti`` runs on: its task's own (``executor=``), else the deployment's default,
    the first of ``[core] executor``."""
    own = getattr(ti, "executor", None)
    if isinstance(own, str) and own.strip():
        return own.strip()
    return str(airflow_conf.get("core", "executor", fallback="")).split(",")[0].strip()


def pod_bound(executor: str) -> bool:
    """Whether ``executor`` (a name, a class path, or ``alias:class path``) runs each task in a
    container of its own that ends with it (:data:`POD_BOUND`): the run's supervisor and its
    client-mode driver end with it too."""
    return executor.split(":")[-1].rsplit(".", 1)[-1].strip() in POD_BOUND


def check_deferral(target_embedded: bool, local_mode: bool, executor: str, log: Any) -> None:
    """Refuse deferral where it loses the run; warn where it frees less than it seems.

    The supervisor and the client-mode driver run beside the task. On a ``KubernetesExecutor`` pod
    (or another container of its own, :func:`pod_bound`) they die with the pod, which ends when the task defers. With the embedded master or
    ``local_mode``, the ranks train on the worker machine: deferral frees the worker slot, not
    the machine's CPUs.
    """
    if pod_bound(executor):
        raise InvalidTrainingConfig(
            f"deferrable=True cannot work on {executor}: the run's supervisor and Spark driver run in "
            "this task's pod (its container), which ends when the task defers. Use deferrable=False (a durable run "
            "still survives a lost task and is reattached by the retry), or a CeleryExecutor worker."
        )
    if target_embedded or local_mode:
        log.warning(
            "Deferring a run whose ranks train on this worker machine (%s): the worker slot is freed, "
            "the machine's CPUs are not.",
            "local_mode" if local_mode else "the embedded Spark master",
        )
