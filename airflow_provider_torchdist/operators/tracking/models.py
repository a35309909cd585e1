"""Models in MLflow: rank 0's returned model (or the run's final checkpoint) logged as the task's
run's artifact, and :func:`register_model`, for a downstream task, which makes it a registered
model version.

What is logged (``mlflow_log_model=True``):

* a ``torch.nn.Module``: an MLflow PyTorch model at ``model`` (``mlflow.pytorch.load_model(uri)``
  loads it back);
* a state dict (a mapping of tensors): ``mlflow.pytorch.log_state_dict`` at ``model``
  (``mlflow.pytorch.load_state_dict(uri)``);
* a dict holding either under ``"model"`` or ``"state_dict"`` (``{"state_dict": ..., "loss": ...}``):
  that entry, as above;
* anything else: this DAG run's newest committed checkpoint (``save_checkpoint``'s), its state
  checked against its manifest and copied out (never a file of the directory as it is: any
  executor can write there, and a symlink planted at a checkpoint's name would otherwise have the
  worker upload whatever file it points to) at ``checkpoint/step-<step>-<run>.pt``, if there is one.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.node.checkpoint_files import CHUNK
from airflow_provider_torchdist.spark.node.checkpoint_manifest import furthest, step_dir
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore

#: The artifact path of a logged model or state dict, and of a logged checkpoint.
MODEL_ARTIFACT = "model"
CHECKPOINT_ARTIFACT = "checkpoint"

log = logging.getLogger(__name__)


def _takes(name: str) -> bool:
    import inspect

    import mlflow.pytorch

    return name in inspect.signature(mlflow.pytorch.log_model).parameters


def _is_state_dict(value: Any) -> bool:
    import torch

    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def log_trained_model(
    client: Any, run_id: str, value: Any, store: CheckpointStore | None, run: dict[str, Any] | None = None
) -> str | None:
    """Log ``value`` (rank 0's return value, decoded) or the newest committed checkpoint of ``run``
    (the DAG run's task) in ``store`` to MLflow run ``run_id``; returns the model's URI
    (``runs:/<id>/model``), or None when there was nothing to log."""
    import mlflow
    import torch

    # mlflow.pytorch logs to the active run of the fluent API: this task's, with the client's URI.
    mlflow.set_tracking_uri(client.tracking_uri)
    if isinstance(value, Mapping) and not _is_state_dict(value):
        value = value.get("model", value.get("state_dict", value))
    if isinstance(value, torch.nn.Module) or _is_state_dict(value):
        with mlflow.start_run(run_id=run_id):
            if isinstance(value, torch.nn.Module):
                # Pickled (cloudpickle): newer releases default to "pt2", which needs an input example.
                options = {"serialization_format": "pickle"} if _takes("serialization_format") else {}
                mlflow.pytorch.log_model(value, name=MODEL_ARTIFACT, **options)
            else:
                mlflow.pytorch.log_state_dict(dict(value), artifact_path=MODEL_ARTIFACT)
        return f"runs:/{run_id}/{MODEL_ARTIFACT}"
    newest = furthest(store.committed(run)) if store is not None else None
    if newest is None:
        log.warning(
            "mlflow_log_model: rank 0 returned a %s, not a torch.nn.Module or a state dict, and the run "
            "left no checkpoint: no model logged. Return the model (or model.state_dict()) from rank 0.",
            type(value).__name__,
        )
        return None
    name = f"{step_dir(newest.step, newest.run)}.pt"
    with (
        tempfile.TemporaryDirectory(prefix="torchdist-checkpoint-") as private,
        store.open_state(newest) as state,
    ):  # type: ignore[union-attr]
        path = Path(private) / name
        with open(path, "wb") as out:
            shutil.copyfileobj(state, out, CHUNK)
        client.log_artifact(run_id, str(path), artifact_path=CHECKPOINT_ARTIFACT)
    return f"runs:/{run_id}/{CHECKPOINT_ARTIFACT}/{name}"


def register_model(
    mlflow_conn_id: str,
    model_uri: str,
    name: str,
    *,
    tags: Mapping[str, str] | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """Register ``model_uri`` (``runs:/<run id>/model``, as a training task's asset event or XCom
    ``mlflow_model_uri`` says) as a new version of registered model ``name`` (created when missing).

    Returns ``{"name": ..., "version": ..., "run_id": ..., "source": ...}``.

    Example, the downstream "promote if better" task::

        @task
        def promote(model_uri: str):
            return register_model("mlflow_default", model_uri, "retrain")

        promote(XComArg(train, key="mlflow_model_uri"))  # or ti.xcom_pull(..., key=...)
    """
    import mlflow

    from airflow_provider_torchdist.operators.tracking.connection import connect, load_target

    target = load_target(mlflow_conn_id)
    connect(target)  # checked: a bad URI or credentials say so
    if not isinstance(model_uri, str) or not model_uri.startswith(("runs:/", "models:/")):
        raise ValueError(
            f"register_model: model_uri must be runs:/<run id>/<path> (the training task's XCom "
            f"mlflow_model_uri, there when it ran with mlflow_log_model=True), got {model_uri!r}"
        )
    mlflow.set_tracking_uri(target.uri)
    mlflow.set_registry_uri(target.uri)
    version = mlflow.register_model(model_uri, name, tags=dict(tags or {}))
    if description:
        mlflow.MlflowClient().update_model_version(name, version.version, description=description)
    return {"name": name, "version": str(version.version), "run_id": version.run_id, "source": version.source}
