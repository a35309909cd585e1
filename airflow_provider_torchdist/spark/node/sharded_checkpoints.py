"""Sharded checkpoints: every rank writes its own shards with torch's distributed checkpoint (DCP),
and one manifest commits them all.

A state holding ``DTensor``s (FSDP2's ``fully_shard``, tensor parallelism, or
``torch.distributed.checkpoint.state_dict.get_state_dict`` of either) is never gathered on one
rank. Each rank has DCP write its shards to a private staging directory in its host's temp dir
(never in the store, where another host's executor could plant a symlink at a name DCP writes),
hashes them, and places them in the step's prefix (renamed, copied across filesystems, or
uploaded); the ranks then exchange what they placed and rank 0 writes the manifest (the commit)
listing every rank's files and DCP's metadata (stored as ``dcp.metadata``: a checkpoint's files
are never hidden). A rank that fails tells the others, so all raise together
and nothing is committed.

A load fetches the files (each checked against the manifest), checks DCP's metadata before DCP
unpickles it (:mod:`~airflow_provider_torchdist.spark.node.dcp_checks`) and has DCP read into the
state the caller passes (its shapes and placements), which reshards a checkpoint written by
another world size.

The ranks coordinate over a gloo group of their own: NCCL groups need GPU tensors, and an
asynchronous save's collectives run beside the training's own. Runs on the Spark side: imports
no Airflow.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from airflow_provider_torchdist.spark.node.checkpoint_io import digest
from airflow_provider_torchdist.spark.node.checkpoint_manifest import Manifest, checked_file_name
from airflow_provider_torchdist.spark.node.checkpoint_state import CheckpointRefused, dump_state
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore, CheckpointStoreError
from airflow_provider_torchdist.spark.node.dcp_checks import (
    METADATA,
    SafeLoadPlanner,
    check_metadata,
    checked_shard_names,
)
from airflow_provider_torchdist.spark.wire.private_files import CHECKPOINT_RESTORE_PREFIX, private_directory

__all__ = ["SHARDED_METADATA", "checkpoint_group", "commit_sharded", "is_sharded", "load_sharded"]

#: DCP's ``.metadata``, as the store keeps it.
SHARDED_METADATA = "dcp.metadata"

_group: Any = None


def _leaves(state: Any) -> Iterator[Any]:
    if isinstance(state, dict):
        for value in state.values():
            yield from _leaves(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _leaves(value)
    else:
        yield state


def is_sharded(state: Any) -> bool:
    """Whether ``state`` holds a ``DTensor`` (a sharded model's or optimizer's state)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(leaf, DTensor) for leaf in _leaves(state))


def checkpoint_group() -> Any:
    """The ranks' gloo group for checkpoints (made on first use: every rank must reach it, as
    every rank calls ``save_checkpoint``); None when torch.distributed is not initialized."""
    global _group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


def exchange(value: Any, group: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order (JSON over tensors: nothing unpickled)."""
    if group is None:
        return [value]
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    most = max(int(size) for size in sizes)
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(o[: int(s)].numpy())) for o, s in zip(out, sizes, strict=True)]


def _raise_any(reports: list[Any], what: str) -> None:
    failed = [f"rank {rank}: {r['error']}" for rank, r in enumerate(reports) if r.get("error")]
    if failed:
        raise CheckpointStoreError(f"{what} failed, nothing committed: " + "; ".join(failed))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def check_plain_values(state: Any, step: int) -> None:
    """``CheckpointRefused`` when a non-tensor value of ``state`` is one a ``weights_only`` load
    would refuse (DCP saves those with ``torch.save``)."""
    values = [leaf for leaf in _leaves(state) if not isinstance(leaf, torch.Tensor)]
    dump_state(values, step, io.BytesIO())


def commit_sharded(
    store: CheckpointStore,
    manifest: Manifest,
    state: Any,
    group: Any,
    write_first: Callable[[], None] | None = None,
) -> Manifest:
    """Write this rank's shards of ``state`` and, with the other ranks, commit the checkpoint of
    ``manifest``'s step; every rank of ``group`` calls it. ``write_first`` (this rank's data
    position) runs before the commit, its failure told to every rank as a shard's would be.
    Returns the committed manifest."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank(group) if group is not None else 0
    staging = store.staging_dir()
    try:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(staging),
            process_group=group,
            no_dist=group is None,
        )
        files = {
            (SHARDED_METADATA if n == METADATA else n): os.path.join(staging, n) for n in os.listdir(staging)
        }
        report: dict[str, Any] = {"files": {}, "error": None}
        try:
            if write_first is not None:  # a rank raising alone would leave the others in DCP's collectives
                write_first()
            for name, path in files.items():
                with open(path, "rb") as source:
                    report["files"][checked_file_name(name)] = digest(source)
            if rank == 0:
                store.begin_step(manifest)  # a step written again is uncommitted from here on
        except Exception as exc:  # noqa: BLE001 - the other ranks must learn it, not wait
            report["error"] = _error(exc)
        _raise_any(exchange(report, group), f"the sharded checkpoint {store.uri_of(manifest)}")
        try:
            for name, path in files.items():
                store.place(manifest, name, path)
        except Exception as exc:  # noqa: BLE001
            report["error"] = _error(exc)
        reports = exchange(report, group)
        _raise_any(reports, f"placing the shards of {store.uri_of(manifest)}")
        recorded = {name: record for r in reports for name, record in r["files"].items()}
        manifest = Manifest(**{**manifest.__dict__, "files": recorded, "sharded": True})
        outcome: dict[str, Any] = {"error": None}
        if rank == 0:
            try:
                store.rewrite_manifest(manifest)
            except Exception as exc:  # noqa: BLE001
                outcome["error"] = _error(exc)
        _raise_any(exchange(outcome, group), f"committing {store.uri_of(manifest)}")
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def files_to_read(state: Any, metadata: Any) -> list[str]:
    """The checkpoint's files that hold what this rank reads into ``state``: DCP's own local load
    plan (its planner, given the checked metadata), mapped to the files of its entries."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})


def load_sharded(
    store: CheckpointStore, manifest: Manifest, state: Any, group: Any, *, weights_only: bool = True
) -> Any:
    """Read the sharded checkpoint of ``manifest`` into ``state`` (in place, resharded by DCP to
    its placements) on every rank of ``group``; returns ``state``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    where = store.uri_of(manifest)
    checked_shard_names(sorted(manifest.files), SHARDED_METADATA, where)
    # A private directory, not a TemporaryDirectory: a rank killed mid-restore leaves it, and the next
    # one made on this host removes it once its process is gone.
    local = private_directory(CHECKPOINT_RESTORE_PREFIX)
    try:
        # Each file checked against the manifest, into a private directory: the metadata first,
        # then the files that hold this rank's part of the state.
        store.fetch(manifest, local, [SHARDED_METADATA])
        metadata_path = os.path.join(local, METADATA)
        os.replace(os.path.join(local, SHARDED_METADATA), metadata_path)
        sizes = {n: int(r["bytes"]) for n, r in manifest.files.items() if n != SHARDED_METADATA}
        metadata = check_metadata(metadata_path, sizes, where)  # before DCP unpickles it, in full
        try:
            needed = files_to_read(state, metadata)
        except KeyError as exc:  # a value's chunk with no entry saying where its bytes are
            raise CheckpointRefused(
                f"refused the sharded checkpoint {where}: its metadata says nothing of where {exc} is stored"
            ) from None
        store.fetch(manifest, local, needed)
        try:
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(local),
                planner=SafeLoadPlanner(where, weights_only),
                process_group=group,
                no_dist=group is None,
            )
        except CheckpointException as exc:  # DCP's wrapper (a BaseException) of each rank's error
            refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointRefused)]
            if refused:
                raise refused[0] from None
            raise
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return state
