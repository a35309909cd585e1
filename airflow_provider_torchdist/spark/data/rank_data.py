"""What a rank reads of ``train_data=``: its shard, as a memory-mapped Arrow table or as tensors.

The driver's Spark stage writes, on each node, one Arrow IPC file per global rank,
``$TORCHDIST_DATA_DIR/rank-<RANK>.arrow``, or, when the Spark tasks ran on the ranks' machine, one
per partition and a manifest of each rank's slices of them (``shards.json``); it sets
``TORCHDIST_DATA_DIR`` in every rank (unset when the run has no ``train_data``). Training code reads it like this::

    from airflow_provider_torchdist import rank_batches

    for epoch in range(epochs):
        for batch in rank_batches(4096, columns=["features", "label"], drop_last=True):
            loss = loss_fn(model(batch["features"]), batch["label"])
            ...

The file is memory-mapped, not read: a shard larger than RAM works, and its pages are the page
cache's, not the rank's own (anonymous) memory, so the kernel can drop and re-read them under
pressure. Runs on the Spark side: imports no Airflow, and pyarrow and torch only when called.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_provider_torchdist.spark.data.batch_order import SHUFFLE_SEED_ENV, checked_epoch, epoch_batches

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch

DATA_DIR_ENV = "TORCHDIST_DATA_DIR"
#: When every Spark task ran on the ranks' machine: which rows of which pieces are each rank's
#: (``{"ranks": {"<RANK>": [[piece file, first row, rows], ...]}}``), instead of a file per rank.
MANIFEST = "shards.json"


def data_environment(directory: str, shuffle_seed: int | None) -> dict[str, str]:
    """What the ranks' environment gets for ``train_data``: their shards' directory and, when the
    task sets ``train_data_shuffle_seed``, the seed ``rank_batches(epoch=)`` reshuffles from."""
    env = {DATA_DIR_ENV: str(directory)}
    if shuffle_seed is not None:
        env[SHUFFLE_SEED_ENV] = str(shuffle_seed)
    return env


def forget_data_environment() -> None:
    """Unset what :func:`data_environment` set (a reused Python worker must not hand it on)."""
    for name in (DATA_DIR_ENV, SHUFFLE_SEED_ENV):
        os.environ.pop(name, None)


def shard_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where global rank ``rank``'s shard lies in ``directory``: ``<directory>/rank-<rank>.arrow``."""
    return Path(directory) / f"rank-{rank}.arrow"


def _this_rank_shard_file() -> Path:
    """This rank's file, or the directory's manifest when the rank has no file of its own."""
    directory = os.environ.get(DATA_DIR_ENV)
    if not directory:
        raise RuntimeError(
            f"this run has no train_data: pass train_data=... to the operator (or the hook); "
            f"{DATA_DIR_ENV} is not set in this rank"
        )
    rank = os.environ.get("RANK")
    if rank is None:
        raise RuntimeError(
            "RANK is not set: rank_shard() and rank_batches() work only inside a rank the provider launched"
        )
    path = shard_file(directory, int(rank))
    if not path.is_file() and (Path(directory) / MANIFEST).is_file():
        path = Path(directory) / MANIFEST
    if not path.is_file():
        raise RuntimeError(
            f"rank {rank} has no shard: {path} does not exist ({DATA_DIR_ENV}={directory}). The run's "
            "staging directory may have been removed, or this process is not one of the run's ranks."
        )
    return path


def rank_shard() -> pa.Table:
    """This rank's rows of ``train_data``, as a ``pyarrow.Table`` backed by a memory map of its file
    (or of its slices of the partitions' files).

    Only the user's columns, in the query's order. Nothing is read until used, so a shard larger
    than RAM works; the table's buffers keep the mapping open for as long as they live.

    Raises RuntimeError when the run has no ``train_data`` or this rank's file is missing.
    """
    import pyarrow as pa

    path = _this_rank_shard_file()
    if path.name != MANIFEST:
        return _mapped(path)
    runs = json.loads(path.read_text())["ranks"][os.environ["RANK"]]
    tables = []
    for name, first, rows in runs:
        piece = _mapped(path.parent / Path(name).name)
        if piece.num_rows < first + rows:
            raise RuntimeError(
                f"{name} holds {piece.num_rows} rows, fewer than the {first + rows} its manifest says"
            )
        tables.append(piece.slice(first, rows))
    return pa.concat_tables(tables)


def _mapped(path: Path) -> pa.Table:
    """The Arrow file at ``path``, memory-mapped; the descriptor is closed, the mapping lives on."""
    import pyarrow as pa

    with pa.memory_map(str(path), "r") as source:
        return pa.ipc.open_file(source).read_all()


def _tensor_kind(field: pa.Field) -> str | None:
    """``"scalar"`` (1-D tensor), ``"fixed_list"`` or ``"list"`` (2-D tensor), or None when no tensor
    can hold it."""
    import pyarrow as pa

    def numeric(t: pa.DataType) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)

    if numeric(field.type):
        return "scalar"
    if pa.types.is_fixed_size_list(field.type) and numeric(field.type.value_type):
        return "fixed_list"
    # Spark's array<float> arrives as a variable-length list: a tensor if every row has the same length
    if (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)) and numeric(
        field.type.value_type
    ):
        return "list"
    return None


def _list_lengths(column: pa.ChunkedArray) -> set[int]:
    """The distinct row lengths of a list column (from its offsets, without touching the values)."""
    import numpy as np

    lengths: set[int] = set()
    for chunk in column.chunks:
        if len(chunk):
            lengths.update(np.unique(np.diff(chunk.offsets.to_numpy())).tolist())
    return lengths


def _check_columns(table: pa.Table, columns: list[str] | None) -> list[str]:
    """The columns to convert, checked: known names, and types and values a tensor can hold."""
    available = table.column_names
    if columns is None:
        columns = list(available)
    elif isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"columns must be a list of column names, got {columns!r}")
    unknown = [c for c in columns if c not in available]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown} in this rank's shard; its columns are {available}")
    for name in columns:
        field = table.schema.field(name)
        kind = _tensor_kind(field)
        if kind is None:
            raise TypeError(
                f"column {name!r} has type {field.type}, which rank_batches cannot turn into a tensor: "
                "it takes integer, floating point and boolean columns, and lists of those whose rows "
                "all have the same length (Spark's array<float>). Select other columns with "
                "columns=[...], or read it with rank_shard()."
            )
        column = table.column(name)
        nulls = column.null_count
        if kind != "scalar" and not nulls:
            nulls = sum(chunk.flatten().null_count for chunk in column.chunks)
        if nulls:
            raise TypeError(
                f"column {name!r} ({field.type}) holds {nulls} null(s), which a tensor cannot: fill or "
                "filter them in the train_data query (coalesce(...), WHERE ... IS NOT NULL)"
            )
        if kind == "list" and len(lengths := _list_lengths(column)) > 1:
            raise TypeError(
                f"column {name!r} ({field.type}) holds lists of different lengths "
                f"({', '.join(map(str, sorted(lengths)[:5]))}{', ...' if len(lengths) > 5 else ''}), "
                "which no 2-D tensor can: pad or trim them to one length in the train_data query"
            )
    return columns


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    import torch

    if array.flags.writeable:
        return torch.from_numpy(array)
    # A view of the read-only memory map: torch warns that it does not support non-writable
    # tensors. We hand it out read-only on purpose (copying would defeat the memory map) and
    # document that writing to it is not allowed, so this one warning is noise here. (torch
    # gives that warning once per process, so the rank's own later conversions will not show it.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _column_tensor(chunks: list[pa.Array], kind: str) -> torch.Tensor:
    """One batch of one column: zero-copy when it lies in one record batch, else one concatenation."""
    import pyarrow as pa

    chunks = [c for c in chunks if len(c)] or chunks[:1]
    array = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
    if kind == "scalar":
        return _from_numpy(_to_numpy(array))
    values = array.flatten()  # the slice's own values, zero-copy
    width = len(values) // len(array) if len(array) else 0  # every row has this length (checked)
    return _from_numpy(_to_numpy(values).reshape(len(array), width))


def _to_numpy(array: pa.Array) -> np.ndarray:
    import pyarrow as pa

    # Arrow packs booleans in bits, so they are the one numeric type that needs a copy.
    return array.to_numpy(zero_copy_only=not pa.types.is_boolean(array.type))


def rank_batches(
    batch_size: int, columns: list[str] | None = None, drop_last: bool = False, *, epoch: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's shard in batches of ``batch_size`` rows: ``{column name: tensor}``.

    With ``epoch=e`` (the loop's epoch number, from 0) the batches of epoch ``e`` come in an order
    drawn from the task's ``train_data_shuffle_seed``, ``e`` and the rank (in the file's order, as
    without ``epoch``, when the task sets no seed), and a checkpoint resumes them exactly::

        start, state = load_latest_checkpoint() or (0, None)   # restores the position, no code
        step = start
        for epoch in range(epochs):
            for batch in rank_batches(4096, epoch=epoch):  # skips what was trained before
                train_step(batch)
                step += 1
                save_checkpoint(state_of(model), step)  # every rank, after the step

    ``save_checkpoint``, called by every rank after the step that used the batch, saves how many
    batches of which epoch were handed out; after ``load_latest_checkpoint()`` this loop yields
    nothing for the epochs already trained and skips exactly the batches already trained of the
    partial one (``docs/checkpoints.md``). With a seed, a batch is a gather of its rows: a copy,
    not a view of the memory map.

    Integer, floating point and boolean columns become 1-D tensors of the same dtype; fixed-size
    lists of those (``pyarrow.list_(pyarrow.float32(), 8)``) become 2-D tensors ``(rows, 8)``, and
    so do lists whose rows all have the same length (Spark's ``array<float>``).
    ``columns`` picks and orders them (default: all, which must then all be of those types).
    The last batch is shorter unless ``drop_last``.

    Zero-copy where Arrow allows: a batch that lies within one record batch of the file is a view
    of the memory map (booleans excepted, which Arrow stores as bits); one that spans record
    batches is concatenated, one copy of ``batch_size`` rows. **The views are read-only**: writing
    to them (in-place ops such as ``batch["x"].mul_(2)`` or ``x[...] = 0``) is not allowed: the map
    is read-only, so the rank dies of a segmentation fault. Use an out-of-place op or ``.clone()``
    first; ``.to(device)`` and ``.float()`` of another dtype copy anyway.

    Raises ValueError for a ``batch_size`` that is not a positive int or an unknown column, and
    TypeError, naming the column and its type, for a column no tensor can hold (strings, lists of
    lists, lists of different lengths, structs, dates, ...) or one with nulls.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if epoch is not None:
        epoch = checked_epoch(epoch)
    table = rank_shard()
    names = _check_columns(table, columns)
    table = table.select(names)
    kinds = {name: _tensor_kind(table.schema.field(name)) for name in names}
    if epoch is None:
        return _batches(table, names, kinds, batch_size, drop_last)

    def convert(part: pa.Table) -> dict[str, torch.Tensor]:
        return {name: _column_tensor(part.column(name).chunks, kinds[name]) for name in names}

    return epoch_batches(table, batch_size, drop_last, epoch, convert)


def _batches(
    table: pa.Table, names: list[str], kinds: dict[str, str | None], batch_size: int, drop_last: bool
) -> Iterator[dict[str, torch.Tensor]]:
    rows = table.num_rows
    end = rows - rows % batch_size if drop_last else rows
    for start in range(0, end, batch_size):
        part = table.slice(start, min(batch_size, end - start))
        yield {name: _column_tensor(part.column(name).chunks, kinds[name]) for name in names}
