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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.node import async_saves
from airflow_provider_torchdist.spark.node import checkpoint_saves as saves
from airflow_provider_torchdist.spark.node.async_saves import CheckpointSaveFailed
from airflow_provider_torchdist.spark.node.checkpoint_files import CheckpointNotAFile
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    Manifest,
    Settings,
    choose_resume,
)
from airflow_provider_torchdist.spark.node.checkpoint_state import (
    CheckpointRefused,
    load_state,
)
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore, Contents, local_path
from airflow_provider_torchdist.spark.node.resume_position import (
    capture_position,
    restore_position,
    write_position,
)
from airflow_provider_torchdist.spark.node.sharded_checkpoints import (
    check_plain_values,
    checkpoint_group,
    is_sharded,
    load_sharded,
)

__all__ = [
    "CHECKPOINT_ENV",
    "CheckpointNotAFile",
    "CheckpointRefused",
    "CheckpointSaveFailed",
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


def save_checkpoint(
    state: Any,
    step: int,
    *,
    metrics: dict[str, Any] | None = None,
    keep: int | None = None,
    all_ranks: bool = False,
    weights_only: bool = True,
    sharded: bool | None = None,
    asynchronous: bool = False,
) -> str | None:
    """Commit ``state`` as the checkpoint of ``step``; returns its URI (None on the ranks that do
    not write). Every rank calls it.

    A plain state (a ``state_dict()``, tensors and plain values) is written by global rank 0 only
    (every rank, each to its own store, with ``all_ranks``). A **sharded** state, one that holds
    ``DTensor``s (FSDP2's ``fully_shard``, tensor parallelism; ``get_state_dict(model, optimizer)``
    of either), is written by every rank, each its own shards, with torch's distributed checkpoint
    (DCP), and committed once for all (``sharded=True`` forces this for any state,
    ``sharded=False`` refuses it). Load it back with ``load_latest_checkpoint(state=...)``.

    Its files are written whole, then its manifest (the commit), so a rank killed mid-write never
    leaves a checkpoint a restart would load. ``metrics`` (numbers, such as ``{"val_loss": 0.2}``)
    are recorded in the manifest, and rank the checkpoints by the task's ``checkpoint_metric``.
    Then retention deletes this DAG run's checkpoints beyond the ``checkpoint_keep_last`` newest
    (``keep`` overrides it) and the ``checkpoint_keep_best`` best.

    With ``asynchronous=True`` it returns once the state is copied (staged); writing and
    uploading go on in a thread beside training. The next save, and the end of the training
    function or script (a finished run, a graceful stop), wait for it; one that failed raises
    ``CheckpointSaveFailed`` there, naming the checkpoint, and fails the run.

    With ``weights_only`` (the default) a state that a ``weights_only`` load would refuse (a numpy
    array, an object of your own class not allowed with ``torch.serialization.add_safe_globals``)
    raises :class:`CheckpointRefused` and is not written.
    """
    store = saves.run_store()  # every rank learns at once that the run has no checkpoint directory
    # This rank's data position and generators now (resume_position), written with the checkpoint.
    position = capture_position(step)
    if sharded is None:
        sharded = is_sharded(state)
    if sharded:
        return saves.save_sharded(store, state, step, metrics, keep, weights_only, asynchronous, position)
    if saves.rank() != 0 and not all_ranks:
        write_position(store, step, position)
        return None
    manifest = saves.new_manifest(step, metrics)
    if not asynchronous:
        async_saves.wait_for_checkpoints()  # one save at a time, committed in order
        return saves.save_plain(state, manifest, keep, weights_only, position)
    if weights_only:
        check_plain_values(state, step)  # refused here, not later in the thread
    async_saves.wait_for_checkpoints()  # the one before reads the staging buffers
    staged = async_saves.stage(state)
    async_saves.start(
        lambda: saves.save_plain(staged, manifest, keep, weights_only, position), step, store.uri_of(manifest)
    )
    return store.uri_of(manifest)


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
    async_saves.wait_for_checkpoints()
    return saves.commit_files(contents, saves.new_manifest(step, metrics), keep)


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
    if saves.rank() == 0:
        print(f"torchdist checkpoints: {why}", flush=True)
    return None if chosen is None else (source, chosen)


def load_latest_checkpoint(
    map_location: Any = "cpu", *, weights_only: bool = True, state: Any = None
) -> tuple[int, Any] | None:
    """``(step, state)`` of the checkpoint this run resumes from, or None: start from the beginning.

    That is this DAG run's newest (an earlier try or restart of the same task wrote it); another
    DAG run's only with the task's ``resume_from`` (``"latest"``, or one checkpoint's URI). Rank 0
    prints which it chose and why.

    A sharded checkpoint (one ``save_checkpoint`` wrote from ``DTensor``s) is read into ``state``,
    which every rank passes: the state dict of the model and optimizer as they are now
    (``get_state_dict(model, optimizer)`` after ``fully_shard``), whose shapes and placements say
    what each rank reads. DCP reshards it, so a checkpoint of 2 ranks resumes on 1 or 4. Load it
    into the model with ``set_state_dict``. A plain checkpoint is returned as loaded; ``state`` is
    then not used.

    Loaded with ``torch.load(..., weights_only=True)``: tensors, numbers, strings and plain
    containers, so a model's or an optimizer's ``state_dict``. A checkpoint holding anything else
    raises :class:`CheckpointRefused` naming it; nothing in it runs. Allow classes of your own with
    ``torch.serialization.add_safe_globals([MyConfig])`` before the call. A sharded checkpoint's
    DCP metadata is checked before DCP reads it, whatever ``weights_only`` says.

    ``weights_only=False`` unpickles in full. **That runs any code the checkpoint holds**, and the
    store is one that every executor of the run can write: one compromised executor could plant a
    newer checkpoint and take over rank 0 on the next restart. Use it only when every host that
    runs the training is trusted as much as the Airflow worker.
    """
    found = resume_choice()
    if found is None:
        return None
    source, chosen = found
    restore_position(source, chosen)  # every rank: its generators and where rank_batches resumes
    if chosen.sharded:
        if state is None:
            raise ValueError(
                f"{source.uri_of(chosen)} is a sharded checkpoint: pass the state to read it into, "
                "load_latest_checkpoint(state=get_state_dict(model, optimizer)) on every rank"
            )
        group = checkpoint_group()
        return chosen.step, load_sharded(source, chosen, state, group, weights_only=weights_only)
    with source.open_state(chosen) as opened:
        loaded = load_state(
            opened, source.uri_of(chosen), map_location=map_location, weights_only=weights_only
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
