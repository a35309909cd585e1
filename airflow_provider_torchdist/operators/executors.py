"""What the deployment's executor means for a run: where its task runs, and whether it may defer."""

from __future__ import annotations

from typing import Any

from airflow.providers.common.compat.sdk import conf as airflow_conf

from airflow_provider_torchdist.errors import InvalidTrainingConfig


def executor_name() -> str:
    """The deployment's executor setting (``[core] executor``), as written."""
    return str(airflow_conf.get("core", "executor", fallback=""))


def pod_bound(executor: str) -> bool:
    """Whether each task runs in a pod of its own that ends with it (``KubernetesExecutor``): the
    run's supervisor and its client-mode driver end with it too."""
    return "KubernetesExecutor" in executor


def check_deferral(target_embedded: bool, local_mode: bool, executor: str, log: Any) -> None:
    """Refuse deferral where it loses the run; warn where it frees less than it seems.

    The supervisor and the client-mode driver run beside the task. On a ``KubernetesExecutor`` pod
    they die with the pod, which ends when the task defers. With the embedded master or
    ``local_mode``, the ranks train on the worker machine: deferral frees the worker slot, not
    the machine's CPUs.
    """
    if pod_bound(executor):
        raise InvalidTrainingConfig(
            f"deferrable=True cannot work on {executor}: the run's supervisor and Spark driver run in "
            "this task's pod, which ends when the task defers. Use deferrable=False (a durable run "
            "still survives a lost task and is reattached by the retry), or a CeleryExecutor worker."
        )
    if target_embedded or local_mode:
        log.warning(
            "Deferring a run whose ranks train on this worker machine (%s): the worker slot is freed, "
            "the machine's CPUs are not.",
            "local_mode" if local_mode else "the embedded Spark master",
        )
