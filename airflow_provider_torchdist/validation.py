"""Checks on user input, shared by the operator (at DAG parse time and after rendering) and the hook."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig


def is_template(value: Any) -> bool:
    """True for a Jinja string that Airflow renders later: it is checked after rendering."""
    return isinstance(value, str) and "{{" in value


def check_int(value: Any, field: str, minimum: int = 1) -> int:
    """An integer >= ``minimum``; a rendered template like ``"2"`` counts as the integer 2."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTrainingConfig(f"{field} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise InvalidTrainingConfig(f"{field} must be an integer >= {minimum}, got {value}")
    return value


def check_bool(value: Any, field: str) -> bool:
    """A bool; a rendered template like ``"True"`` or ``"false"`` counts as the bool."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise InvalidTrainingConfig(f"{field} must be True or False, got {value!r}")
    return value


def check_train_object(value: Any) -> Callable[..., Any] | str:
    """A callable, or the path of a Python script (``str`` or ``os.PathLike``)."""
    if callable(value):
        return value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value
    raise InvalidTrainingConfig(
        f"train_object must be a callable or the path of a .py training script, got {type(value).__name__}: "
        f"{value!r}"
    )


def check_topology(num_processes: Any, nproc_per_node: Any, local_mode: Any) -> tuple[int, int, bool]:
    """``num_processes`` is the total; in distributed mode it must split evenly across nodes."""
    num_processes = check_int(num_processes, "num_processes")
    nproc_per_node = check_int(nproc_per_node, "nproc_per_node")
    local_mode = check_bool(local_mode, "local_mode")
    if not local_mode and num_processes % nproc_per_node:
        raise InvalidTrainingConfig(
            f"num_processes={num_processes} is not divisible by nproc_per_node={nproc_per_node}: "
            "num_processes is the total number of ranks, split evenly across Spark tasks. "
            f"Use e.g. num_processes={num_processes - num_processes % nproc_per_node or nproc_per_node}."
        )
    return num_processes, nproc_per_node, local_mode


def check_args(value: Any, field: str, kind: type) -> Any:
    """``args`` must be a list or tuple and ``kwargs`` a dict (None means empty)."""
    if value is None:
        return kind()
    accepted = (list, tuple) if kind is list else (dict,)
    if not isinstance(value, accepted):
        raise InvalidTrainingConfig(
            f"{field} must be a {kind.__name__}, got {type(value).__name__}: {value!r}"
        )
    if kind is dict and not all(isinstance(k, str) for k in value):
        raise InvalidTrainingConfig(f"{field} keys must be strings, got {list(value)!r}")
    return list(value) if kind is list else dict(value)


def check_deploy_mode(value: Any) -> None:
    """Only client mode: the driver must run on the Airflow worker, where the hook reads its verdict."""
    if str(value or "").strip().lower() == "cluster":
        raise InvalidTrainingConfig(
            "deploy_mode='cluster' is not supported: the driver reports rank 0's value and each "
            "rank's failure to the Airflow worker, so it must run there (client mode). Remove "
            "deploy-mode from the connection or pass deploy_mode='client'."
        )


def check_unencrypted_allowed(conf: Mapping[str, Any] | None, allow_unencrypted: bool) -> None:
    """Refuse to mix an encrypted Spark cluster with torch's unencrypted traffic unless told to."""
    if (
        str((conf or {}).get("spark.ssl.enabled", "false")).strip().lower() == "true"
        and not allow_unencrypted
    ):
        raise InvalidTrainingConfig(
            "spark.ssl.enabled=true, but torch.distributed traffic (gloo/NCCL collectives, the "
            "rendezvous store) and this provider's run channel between ranks and driver are not "
            "encrypted, so training data and gradients would cross the network in the clear. Run on a "
            "network you trust and pass allow_unencrypted=True to accept this."
        )
