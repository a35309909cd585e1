"""Run a PyTorch training callable or script as a distributed job on Spark, from Airflow.

Public names: :class:`TorchDistributorOperator`, :class:`TorchDistributorHook`, :func:`load_output`,
:func:`output_origin`, :func:`torch_distributor_task` (``@task.torch_distributor``),
and for training code :func:`report`, :func:`save_checkpoint`, :func:`load_latest_checkpoint`
and :func:`checkpoint_dir` / :func:`checkpoint_uri`, :func:`wait_for_checkpoints` (an asynchronous
save is committed), :func:`load_checkpoint` (a downstream task opens a
kept checkpoint), :func:`stop_requested` (the run is being stopped: checkpoint and
return), :func:`set_output` (a script's rank 0 hands a value on), and for reading ``train_data`` in a rank :func:`rank_shard` (a
memory-mapped ``pyarrow.Table``) and :func:`rank_batches` (dicts of tensors).
They load lazily, so the Spark side (``airflow_provider_torchdist.spark``), which ships to the
cluster inside this package, never imports Airflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "TorchDistributorHook",
    "TorchDistributorOperator",
    "checkpoint_dir",
    "checkpoint_uri",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_output",
    "output_origin",
    "rank_batches",
    "rank_shard",
    "report",
    "save_checkpoint",
    "set_output",
    "stop_requested",
    "torch_distributor_task",
    "wait_for_checkpoints",
]

_LAZY = {
    "TorchDistributorOperator": "airflow_provider_torchdist.operators.torch_distributor",
    "TorchDistributorHook": "airflow_provider_torchdist.hooks.torch_distributor",
    "load_output": "airflow_provider_torchdist.outputs.results",
    "output_origin": "airflow_provider_torchdist.outputs.results",
    "report": "airflow_provider_torchdist.spark.node.metrics",
    "checkpoint_dir": "airflow_provider_torchdist.spark.node.checkpoints",
    "checkpoint_uri": "airflow_provider_torchdist.spark.node.checkpoints",
    "load_checkpoint": "airflow_provider_torchdist.operators.checkpoint_registry",
    "save_checkpoint": "airflow_provider_torchdist.spark.node.checkpoints",
    "load_latest_checkpoint": "airflow_provider_torchdist.spark.node.checkpoints",
    "wait_for_checkpoints": "airflow_provider_torchdist.spark.node.async_saves",
    "rank_shard": "airflow_provider_torchdist.spark.data.rank_data",
    "rank_batches": "airflow_provider_torchdist.spark.data.rank_data",
    "stop_requested": "airflow_provider_torchdist.spark.node.stop",
    "set_output": "airflow_provider_torchdist.spark.node.script_output",
    "torch_distributor_task": "airflow_provider_torchdist.decorators.torch_distributor",
}

if TYPE_CHECKING:
    from airflow_provider_torchdist.decorators.torch_distributor import torch_distributor_task
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
    from airflow_provider_torchdist.operators.checkpoint_registry import load_checkpoint
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
    from airflow_provider_torchdist.outputs.results import load_output, output_origin
    from airflow_provider_torchdist.spark.data.rank_data import rank_batches, rank_shard
    from airflow_provider_torchdist.spark.node.async_saves import wait_for_checkpoints
    from airflow_provider_torchdist.spark.node.checkpoints import (
        checkpoint_dir,
        checkpoint_uri,
        load_latest_checkpoint,
        save_checkpoint,
    )
    from airflow_provider_torchdist.spark.node.metrics import report
    from airflow_provider_torchdist.spark.node.script_output import set_output
    from airflow_provider_torchdist.spark.node.stop import stop_requested


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
