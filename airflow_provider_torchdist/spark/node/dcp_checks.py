"""What a sharded checkpoint's reader checks before torch's distributed checkpoint (DCP) reads it.

DCP trusts its files: ``FileSystemReader.read_metadata`` unpickles ``.metadata`` in full, and the
default planner loads every non-tensor value with ``torch.load(weights_only=False)``. The store is
one that every executor of a run can write, so a planted checkpoint would run its code on every
rank that resumes from it. Here:

- the checkpoint's files are DCP's data files and its metadata, nothing else;
- ``.metadata`` is unpickled first with an unpickler that creates only DCP's own metadata classes
  (and ``torch.Size``, dtypes, layouts, paths); anything else is refused, nothing of it run. Its
  entries must name files of the checkpoint's manifest, lie within them, and use no stream
  transform (this project writes none: a transform would be a decompressor run on planted data).
  Only then does DCP's reader unpickle the same bytes, from a private directory.
- each non-tensor value is loaded ``weights_only=True`` before DCP's planner loads it (tensors DCP
  already loads ``weights_only``).

The second through DCP's public extension point for it, a ``LoadPlanner`` that checks and then
hands on to DCP's own code. Runs on the Spark side: imports no Airflow.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from airflow_provider_torchdist.spark.node.checkpoint_state import CheckpointRefused, load_state

__all__ = ["METADATA", "SafeLoadPlanner", "check_metadata", "checked_shard_names"]

#: DCP's metadata file, as DCP names it in a checkpoint's directory.
METADATA = ".metadata"
#: The data files DCP's ``FileSystemWriter`` writes: ``__<rank>_<n>.distcp``. Nothing else is
#: fetched for DCP to read (it would read a per-rank ``__<rank>.metadata`` with a full unpickle).
SHARD_FILE = re.compile(r"^__\d{1,6}_\d{1,6}\.distcp$")
#: The most of a ``.metadata`` that is read: one entry per tensor shard, some hundred bytes each.
MAX_METADATA_BYTES = 64 * 1024 * 1024

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Creates DCP's metadata classes and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def checked_shard_names(names: list[str], metadata_name: str, where: str) -> list[str]:
    """``names`` (a sharded checkpoint's files) when they are ``metadata_name`` and DCP data files
    only; :class:`CheckpointRefused` naming ``where`` otherwise."""
    odd = [n for n in names if n != metadata_name and not SHARD_FILE.match(n)]
    if odd or metadata_name not in names:
        raise CheckpointRefused(
            f"refused the sharded checkpoint {where}: its files must be {metadata_name} and DCP's "
            f"__<rank>_<n>.distcp, not {odd or names}"
        )
    return names


def check_metadata(path: str, files: dict[str, int], where: str) -> Any:
    """The metadata in the DCP ``.metadata`` file at ``path``, unpickled with only DCP's metadata
    classes allowed, its entries checked against ``files`` (the checkpoint's file names and sizes);
    :class:`CheckpointRefused` naming ``where`` otherwise."""
    with open(path, "rb") as source:
        data = source.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointRefused(
            f"refused the checkpoint {where}: its metadata is over {MAX_METADATA_BYTES} bytes"
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is not DCP's metadata
        raise CheckpointRefused(
            f"refused the sharded checkpoint {where}: its metadata is not DCP's ({exc}); nothing in it was run"
        ) from None
    storage = getattr(metadata, "storage_data", None)
    described = getattr(metadata, "state_dict_metadata", None)
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(storage, dict)
        or not isinstance(described, dict)
        or not isinstance(metadata.storage_meta, StorageMeta | None)
        or not all(_is_item(item) for item in described.values())
    ):
        # DCP's planner would fail on it with a bare KeyError or AttributeError, or misread it.
        raise CheckpointRefused(f"refused the sharded checkpoint {where}: its metadata is not DCP's")
    for entry in storage.values():
        _check_entry(entry, files, where)
    return metadata


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size and all(n >= 0 for n in value)


def _is_item(item: Any) -> bool:
    """Whether ``item`` is one value's metadata as DCP writes it: bytes, or a tensor whose chunks
    lie within it (each with its entry in the storage data, checked by the planner's lookup)."""
    if type(item) is BytesStorageMetadata:
        return True
    if type(item) is not TensorStorageMetadata or not isinstance(item.properties, TensorProperties):
        return False
    size, chunks = item.size, item.chunks
    return (
        _is_size(size)
        and isinstance(chunks, list)
        and all(
            type(c) is ChunkStorageMetadata
            and _is_size(c.offsets)
            and _is_size(c.sizes)
            and len(c.offsets) == len(c.sizes) == len(size)
            and all(o + n <= s for o, n, s in zip(c.offsets, c.sizes, size, strict=True))
            for c in chunks
        )
    )


def _check_entry(entry: Any, files: dict[str, int], where: str) -> None:
    name, offset, length = (getattr(entry, a, None) for a in ("relative_path", "offset", "length"))
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length))
    if not isinstance(name, str) or name not in files or not ints:
        raise CheckpointRefused(
            f"refused the sharded checkpoint {where}: its metadata names {name!r}, not one of its files"
        )
    if offset + length > files[name]:
        raise CheckpointRefused(
            f"refused the sharded checkpoint {where}: its metadata reads past the end of {name}"
        )
    if getattr(entry, "transform_descriptors", None):
        raise CheckpointRefused(
            f"refused the sharded checkpoint {where}: it asks for stream transforms "
            f"{entry.transform_descriptors!r}, which this project never writes"
        )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading each non-tensor value ``weights_only`` first (DCP's own load
    of them is a full unpickle); ``weights_only=False`` skips the check."""

    def __init__(self, where: str, weights_only: bool = True) -> None:
        super().__init__()
        self._where, self._weights_only = where, weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._weights_only:
            load_state(value.getvalue(), self._where)  # CheckpointRefused for anything beyond data
            value.seek(0)
        super().load_bytes(read_item, value)
