"""The task's side of checkpoints: who the run is (so a new DAG run never resumes another's
checkpoints silently), what a succeeded run leaves in XCom ``checkpoints``, and
:func:`load_checkpoint`, which opens one in a downstream task.

The ranks commit and prune checkpoints themselves
(:mod:`~airflow_provider_torchdist.spark.node.checkpoints`); once the run succeeded, the task marks
its checkpoints' manifests ``finished`` and pushes the kept ones, best first by
``checkpoint_metric`` (else newest first)::

    [{"uri": "s3://bucket/ckpt/step-000000040-3f2a9c1b0d4e", "step": 40,
      "metrics": {"val_loss": 0.21}, "time": 1764300000.0, "conn_id": "aws_ckpt"}, ...]
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from airflow.providers.common.compat.sdk import conf as airflow_conf

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.outputs import run_paths
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    RUN_ENV,
    STEP_DIR,
    Manifest,
    Policy,
    best_first,
    run_env,
)
from airflow_provider_torchdist.spark.node.checkpoint_state import load_state
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.checkpoint_storage import storage_options

#: XCom key of the kept checkpoints of a succeeded run, best first.
CHECKPOINTS_XCOM_KEY = "checkpoints"


def run_identity(ti: Any) -> dict[str, Any]:
    """The DAG run and task that own the run, as the manifests record them."""
    map_index = getattr(ti, "map_index", -1)
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": -1 if map_index is None else int(map_index),
    }


def with_run_identity(spec: TrainingSpec, ti: Any) -> TrainingSpec:
    """``spec`` whose ranks know which DAG run and task they train for (``TORCHDIST_CHECKPOINT_RUN``)."""
    if not spec.checkpoint_dir:
        return spec
    who = run_identity(ti)
    value = run_env(
        who["dag_id"], who["run_id"], who["task_id"], who["map_index"], getattr(ti, "try_number", None)
    )
    return dataclasses.replace(spec, rank_env={**spec.rank_env, RUN_ENV: value})


def _policy(spec: TrainingSpec) -> Policy:
    return Policy(
        keep_last=spec.checkpoint_keep_last,
        keep_best=spec.checkpoint_keep_best,
        metric=spec.checkpoint_metric,
        mode=spec.checkpoint_mode,
    )


def _entry(store: CheckpointStore, manifest: Manifest, conn_id: str | None) -> dict[str, Any]:
    return {
        "uri": store.uri_of(manifest),
        "step": manifest.step,
        "metrics": dict(manifest.metrics),
        "time": manifest.time,
        "conn_id": conn_id,
    }


def finish_checkpoints(ti: Any, spec: TrainingSpec, log: Any) -> list[dict[str, Any]]:
    """After the run succeeded: mark this DAG run's checkpoints finished, and push the kept ones to
    ``ti``'s XCom ``checkpoints``, best first. Returns what it pushed (``[]`` when none)."""
    if not spec.checkpoint_dir:
        return []
    uri = str(spec.checkpoint_dir)
    store = CheckpointStore(uri, storage_options(spec.checkpoint_conn_id, uri))
    mine = store.committed(run_identity(ti))
    for manifest in mine:
        if not manifest.finished:
            store.rewrite_manifest(dataclasses.replace(manifest, finished=True))
    entries = [_entry(store, m, spec.checkpoint_conn_id) for m in best_first(mine, _policy(spec))]
    ti.xcom_push(key=CHECKPOINTS_XCOM_KEY, value=entries)
    prune_default_runs(ti, uri, log)
    if entries:
        log.info(
            "Checkpoints kept: %d (XCom %r), first %s at step %d.",
            len(entries),
            CHECKPOINTS_XCOM_KEY,
            entries[0]["uri"],
            entries[0]["step"],
        )
    return entries


def best_checkpoint(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The model asset event's share: ``{"best_checkpoint": <the best kept one's URI>}``, or ``{}``."""
    return {"best_checkpoint": entries[0]["uri"]} if entries else {}


def prune_default_runs(ti: Any, uri: str, log: Any, keep: int | None = None) -> list[str]:
    """Remove older finished DAG runs' default checkpoint directories of this task, beyond
    ``[torchdist] checkpoint_runs_kept`` (this run included); returns what it removed.

    Only when ``uri`` is the task's default directory: a ``checkpoint_dir`` the DAG sets is the
    DAG's to manage. A run whose checkpoints are not all finished (it failed, or is still being
    retried) keeps its directory: its retry resumes from it.
    """
    if uri != run_paths.default_checkpoint_dir(ti):
        return []
    if keep is None:
        keep = int(airflow_conf.get("torchdist", "checkpoint_runs_kept", fallback="3"))
    if keep <= 0:
        return []
    task_dir = Path(uri)
    finished: list[tuple[float, Path]] = []
    for sibling in task_dir.parent.parent.glob(f"*/{task_dir.name}"):
        if sibling == task_dir or sibling.is_symlink() or not sibling.is_dir():
            continue
        manifests = CheckpointStore(str(sibling)).committed()
        if manifests and all(m.finished for m in manifests):
            finished.append((max(m.time for m in manifests), sibling))
    removed = [path for _, path in sorted(finished, reverse=True)[keep - 1 :]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        log.info(
            "Removed the checkpoints of an older finished DAG run: %s (checkpoint_runs_kept=%d).", path, keep
        )
    return [str(p) for p in removed]


def _pick(entries: list[dict[str, Any]], which: str | int) -> dict[str, Any]:
    if not entries:
        raise InvalidTrainingConfig(
            "no checkpoints to load: the training task's XCom 'checkpoints' is empty (did it call "
            "save_checkpoint, and did it succeed?)"
        )
    if which == "best":
        return entries[0]
    if which == "latest":
        return max(entries, key=lambda e: (e["step"], e["time"]))  # one run's: its steps only grow
    if isinstance(which, int) and not isinstance(which, bool):
        for entry in entries:
            if entry["step"] == which:
                return entry
        raise InvalidTrainingConfig(
            f"no kept checkpoint of step {which}; the kept steps are {sorted(e['step'] for e in entries)}"
        )
    raise InvalidTrainingConfig(f"which must be 'best', 'latest' or a step (an int), got {which!r}")


def load_checkpoint(
    ti_or_xcom: Any,
    which: str | int = "best",
    *,
    task_id: str | None = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
    state: Any = None,
) -> Any:
    """The state of one of a training task's kept checkpoints, loaded where this (Airflow) task runs.

    ``ti_or_xcom``: the training task's XCom ``checkpoints`` (a list), or a task instance whose
    ``xcom_pull`` gets it from ``task_id``. ``which``: ``"best"`` (first by ``checkpoint_metric``),
    ``"latest"``, or a step. Loaded with ``torch.load(weights_only=True)`` unless told otherwise
    (``weights_only=False`` runs any code the checkpoint holds: only for stores every writer of
    which you trust). Example::

        @task
        def evaluate(ti):
            state = load_checkpoint(ti, "best", task_id="train")
            model.load_state_dict(state["model"])

    A sharded checkpoint (FSDP2, ``DTensor``s) is read into ``state``, a state dict of the
    unsharded model here (``{"model": model.state_dict()}``), in place: DCP gathers the shards
    into it, whatever world size wrote them.
    """
    entries = ti_or_xcom
    if hasattr(ti_or_xcom, "xcom_pull"):
        if not task_id:
            raise InvalidTrainingConfig("load_checkpoint(ti, ...) needs task_id=: the training task's id")
        entries = ti_or_xcom.xcom_pull(task_ids=task_id, key=CHECKPOINTS_XCOM_KEY)
    entry = _pick(list(entries or []), which)
    return open_checkpoint(
        entry["uri"], entry.get("conn_id"), map_location=map_location, weights_only=weights_only, state=state
    )


def open_checkpoint(
    uri: str,
    conn_id: str | None = None,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
    state: Any = None,
) -> Any:
    """Load the checkpoint at ``uri`` (``<checkpoint_dir>/step-<step>-<run>``): committed, and its
    files as its manifest says, or this raises. A sharded one is read into ``state`` (see
    :func:`load_checkpoint`)."""
    base, _, name = uri.rstrip("/").rpartition("/")
    if not STEP_DIR.match(name):
        raise InvalidTrainingConfig(f"{uri!r} is not a checkpoint's URI (<checkpoint_dir>/step-<step>-<run>)")
    store = CheckpointStore(base, storage_options(conn_id, base))
    manifest = store.manifest_of(name)
    if manifest is None:
        raise InvalidTrainingConfig(
            f"no committed checkpoint at {uri!r}: it was deleted by retention, or never committed"
        )
    if manifest.sharded:
        if state is None:
            raise InvalidTrainingConfig(
                f"{uri} is a sharded checkpoint (FSDP2, DTensors): pass state= (a state dict of the "
                "unsharded model, such as {'model': model.state_dict()}) to read it into"
            )
        from airflow_provider_torchdist.spark.node.sharded_checkpoints import load_sharded

        return load_sharded(store, manifest, state, None, weights_only=weights_only)
    with store.open_state(manifest) as opened:
        return load_state(opened, uri, map_location=map_location, weights_only=weights_only)
