"""How ``save_checkpoint`` writes: the manifest of a new checkpoint, a plain state's commit by one
rank, a sharded state's by all (:mod:`~airflow_provider_torchdist.spark.node.sharded_checkpoints`),
either one now or staged and in a thread (:mod:`~airflow_provider_torchdist.spark.node.async_saves`),
then retention. Runs on the Spark side: imports no Airflow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchdist.spark.node import async_saves
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    Manifest,
    Settings,
    clean_metrics,
    to_keep,
)
from airflow_provider_torchdist.spark.node.checkpoint_state import dump_state
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore, Contents
from airflow_provider_torchdist.spark.node.resume_position import write_position
from airflow_provider_torchdist.spark.node.sharded_checkpoints import (
    check_plain_values,
    checkpoint_group,
    commit_sharded,
)


def run_store() -> CheckpointStore:
    """The run's checkpoint store; RuntimeError when the run has none."""
    store = CheckpointStore.from_env()
    if store is None:
        raise RuntimeError(f"no checkpoint directory: {CHECKPOINT_ENV} is not set (set checkpoint_dir=)")
    return store


def rank() -> int:
    """This process's global rank (0 outside a run)."""
    return int(os.environ.get("RANK", "0"))


def save_plain(state: Any, manifest: Manifest, keep: int | None, weights_only: bool, position: bytes) -> str:
    """Commit ``state`` as ``state.pt`` (``torch.save``) under ``manifest``, then this rank's
    ``position`` (nothing of a refused state is left), then retention; its URI."""

    def write(out: Any) -> None:
        dump_state(state, manifest.step, out, weights_only=weights_only)

    store = run_store()
    # Streamed into private temporary files and committed from there: never whole in memory here.
    committed = store.commit(manifest, write)
    write_position(store, manifest.step, position)
    apply_retention(store, committed, keep)
    return store.uri_of(committed)


def save_sharded(
    store: CheckpointStore,
    state: Any,
    step: int,
    metrics: dict[str, Any] | None,
    keep: int | None,
    weights_only: bool,
    asynchronous: bool,
    position: bytes,
) -> str:
    """Commit a sharded ``state`` with every rank (now, or staged and in a thread), then
    retention on rank 0; the checkpoint's URI."""
    if weights_only:
        check_plain_values(state, step)
    group = checkpoint_group()  # made here, on the training thread, by every rank
    manifest = new_manifest(step, metrics)

    def save(state: Any) -> str:
        # Every rank's position, before the commit that makes it count; a failure fails all ranks.
        committed = commit_sharded(
            store, manifest, state, group, lambda: write_position(store, step, position)
        )
        if rank() == 0:
            apply_retention(store, committed, keep)
        return store.uri_of(committed)

    # One save at a time: the group's collectives in order, and the staging buffers free.
    async_saves.wait_for_checkpoints()
    if not asynchronous:
        return save(state)
    staged = async_saves.stage(state)
    async_saves.start(lambda: save(staged), step, store.uri_of(manifest))
    return store.uri_of(manifest)


def new_manifest(step: int, metrics: dict[str, Any] | None) -> Manifest:
    """The manifest of a new checkpoint of ``step`` by this run (its files are added on commit)."""
    settings = Settings.from_env()
    return Manifest(
        step=int(step),
        time=time.time(),
        metrics=clean_metrics(metrics),
        run=settings.run,
        try_number=settings.try_number,
    )


def commit_files(contents: Contents | Mapping[str, Contents], manifest: Manifest, keep: int | None) -> str:
    """Commit ``contents`` (one file's, or ``{name: contents}``) under ``manifest``, then retention."""
    store = run_store()
    # Streamed into private temporary files and committed from there: never whole in memory here.
    manifest = store.commit(manifest, contents)
    apply_retention(store, manifest, keep)
    return store.uri_of(manifest)


def apply_retention(store: CheckpointStore, manifest: Manifest, keep: int | None) -> None:
    """Delete this DAG run's checkpoints beyond the policy's (``keep`` overriding ``keep_last``),
    never ``manifest``'s."""
    settings = Settings.from_env()
    policy = settings.policy
    if keep is not None:
        policy = type(policy)(**{**policy.__dict__, "keep_last": int(keep)})
    mine = store.committed(settings.run)
    kept = {m.step for m in to_keep(mine, policy)} | {manifest.step}
    for old in mine:
        if old.step not in kept:
            store.delete(old)
