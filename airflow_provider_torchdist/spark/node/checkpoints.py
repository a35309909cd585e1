"""Checkpoints that survive torchrun restarts and Airflow retries of the same DAG run, on a local
directory or in object storage.

The operator gives every task a checkpoint directory (by default
``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>``, or ``checkpoint_dir=``: a path or any
fsspec URI such as ``s3://bucket/prefix``), and every rank finds it in ``TORCHDIST_CHECKPOINT_DIR``.
Training code resumes like this::

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    start, state = load_latest_checkpoint() or (0, None)
    if state:
        model.load_state_dict(state["model"])
    for step in range(start, steps):
        ...
        if (step + 1) % 10 == 0:
            save_checkpoint({"model": model.state_dict()}, step + 1, metrics={"val_loss": val_loss})

Each checkpoint is committed by a manifest written after its files
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_store`), which records the DAG run and
task that wrote it: a run resumes its own checkpoints (an earlier try, a torchrun restart), never
another DAG run's unless the task says ``resume_from=``; the log says which it did and why
(:func:`~airflow_provider_torchdist.spark.node.checkpoint_manifest.choose_resume`). Retention keeps
the ``checkpoint_keep_last`` newest and the ``checkpoint_keep_best`` best by ``checkpoint_metric``.

Checkpoints are loaded with ``torch.load(..., weights_only=True)``
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_state`): tensors, numbers, strings and
plain containers, never arbitrary pickled objects, since every executor of the run can write the
store. Classes of your own can be allowed by name with
``torch.serialization.add_safe_globals([MyConfig])`` at the top of the training function;
``weights_only=False`` opts back into full pickle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.node.checkpoint_files import CheckpointNotAFile
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    Manifest,
    Settings,
    choose_resume,
    clean_metrics,
    to_keep,
)
from airflow_provider_torchdist.spark.node.checkpoint_state import (
    CheckpointRefused,
    dump_state,
    load_state,
)
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore, Contents, local_path

__all__ = [
    "CHECKPOINT_ENV",
    "CheckpointNotAFile",
    "CheckpointRefused",
    "checkpoint_dir",
    "checkpoint_uri",
    "commit_checkpoint",
    "load_latest_checkpoint",
    "save_checkpoint",
]


def checkpoint_uri() -> str | None:
    """This task's checkpoint directory as given (a path or a URI such as ``s3://bucket/ckpt``), or
    None when the run has none."""
    return os.environ.get(CHECKPOINT_ENV) or None


def checkpoint_dir() -> Path | None:
    """This task's checkpoint directory when it is local (``file:///shared/ckpt`` names the path
    ``/shared/ckpt``); None when the run has none or keeps checkpoints in a remote store (see
    :func:`checkpoint_uri`)."""
    value = checkpoint_uri()
    path = local_path(value) if value else None
    return Path(path) if path else None


def _store() -> CheckpointStore:
    store = CheckpointStore.from_env()
    if store is None:
        raise RuntimeError(f"no checkpoint directory: {CHECKPOINT_ENV} is not set (set checkpoint_dir=)")
    return store


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def save_checkpoint(
    state: Any,
    step: int,
    *,
    metrics: dict[str, Any] | None = None,
    keep: int | None = None,
    all_ranks: bool = False,
    weights_only: bool = True,
) -> str | None:
    """Commit ``state`` as the checkpoint of ``step`` (global rank 0 only, unless ``all_ranks``);
    returns its URI (None on the ranks that do not write).

    Its files are written whole, then its manifest (the commit), so a rank killed mid-write never
    leaves a checkpoint a restart would load. ``metrics`` (numbers, such as ``{"val_loss": 0.2}``)
    are recorded in the manifest, and rank the checkpoints by the task's ``checkpoint_metric``.
    Then retention deletes this DAG run's checkpoints beyond the ``checkpoint_keep_last`` newest
    (``keep`` overrides it) and the ``checkpoint_keep_best`` best.

    With ``weights_only`` (the default) a state that a ``weights_only`` load would refuse (a numpy
    array, an object of your own class not allowed with ``torch.serialization.add_safe_globals``)
    raises :class:`CheckpointRefused` and is not written.
    """
    if _rank() != 0 and not all_ranks:
        _store()  # every rank learns at once that the run has no checkpoint directory
        return None
    return commit_checkpoint(
        lambda out: dump_state(state, step, out, weights_only=weights_only), step, metrics=metrics, keep=keep
    )


def commit_checkpoint(
    contents: Contents | Mapping[str, Contents],
    step: int,
    *,
    metrics: dict[str, Any] | None = None,
    keep: int | None = None,
) -> str:
    """Commit a checkpoint of ``step`` whose files are ``contents`` (``state.pt``'s, or
    ``{name: contents}``) in this process, then apply retention to this DAG run's checkpoints;
    returns its URI. What ``save_checkpoint`` and the framework callbacks share."""
    store = _store()
    settings = Settings.from_env()
    manifest = Manifest(
        step=int(step),
        time=time.time(),
        metrics=clean_metrics(metrics),
        run=settings.run,
        try_number=settings.try_number,
    )
    # Streamed into private temporary files and committed from there: never whole in memory here.
    manifest = store.commit(manifest, contents)
    policy = settings.policy
    if keep is not None:
        policy = type(policy)(**{**policy.__dict__, "keep_last": int(keep)})
    mine = store.committed(settings.run)
    kept = {m.step for m in to_keep(mine, policy)} | {manifest.step}
    for old in mine:
        if old.step not in kept:
            store.delete(old)
    return store.uri_of(manifest)


def resume_choice() -> tuple[CheckpointStore, Manifest] | None:
    """The store and manifest of the checkpoint this run resumes from (see
    :func:`load_latest_checkpoint`), or None: start from the beginning. Rank 0 prints which it
    chose and why."""
    store = CheckpointStore.from_env()
    if store is None:
        return None
    settings = Settings.from_env()
    if settings.resume_from and settings.resume_from != "latest":
        source, chosen, why = _named(store, settings.resume_from)
    else:
        source = store
        chosen, why = choose_resume(store.committed(), settings, store.uri)
    if _rank() == 0:
        print(f"torchdist checkpoints: {why}", flush=True)
    return None if chosen is None else (source, chosen)


def load_latest_checkpoint(map_location: Any = "cpu", *, weights_only: bool = True) -> tuple[int, Any] | None:
    """``(step, state)`` of the checkpoint this run resumes from, or None: start from the beginning.

    That is this DAG run's newest (an earlier try or restart of the same task wrote it); another
    DAG run's only with the task's ``resume_from`` (``"latest"``, or one checkpoint's URI). Rank 0
    prints which it chose and why.

    Loaded with ``torch.load(..., weights_only=True)``: tensors, numbers, strings and plain
    containers, so a model's or an optimizer's ``state_dict``. A checkpoint holding anything else
    raises :class:`CheckpointRefused` naming it; nothing in it runs. Allow classes of your own with
    ``torch.serialization.add_safe_globals([MyConfig])`` before the call.

    ``weights_only=False`` unpickles in full. **That runs any code the checkpoint holds**, and the
    store is one that every executor of the run can write: one compromised executor could plant a
    newer checkpoint and take over rank 0 on the next restart. Use it only when every host that
    runs the training is trusted as much as the Airflow worker.
    """
    found = resume_choice()
    if found is None:
        return None
    source, chosen = found
    with source.open_state(chosen) as state:
        loaded = load_state(
            state, source.uri_of(chosen), map_location=map_location, weights_only=weights_only
        )
    return chosen.step, loaded


def _named(store: CheckpointStore, uri: str) -> tuple[CheckpointStore, Manifest | None, str]:
    """``resume_from=<a checkpoint's URI>``: its store (with the run's storage options) and manifest."""
    base, _, name = uri.rstrip("/").rpartition("/")
    source = store if base == store.uri else CheckpointStore(base, store.storage_options)
    manifest = source.manifest_of(name)
    if manifest is None:
        raise FileNotFoundError(
            f"resume_from={uri!r} names no committed checkpoint (deleted by retention, or never "
            "committed): pick one from a training task's checkpoints XCom, or resume_from='latest'"
        )
    return source, manifest, f"resuming from step {manifest.step} (resume_from={uri!r})"
