"""``rank_batches(..., epoch=e)``: this rank's rows in a new order each epoch, and a position that a
checkpoint saves and a resume skips to.

The order of epoch ``e`` is a permutation of the rank's rows drawn from ``(train_data_shuffle_seed,
e, RANK)`` with NumPy's ``default_rng``: the same on every try and restart, another each epoch, and
independent of the training's own generators (it draws nothing from them). Without a seed the rows
come in order, every epoch. The task's seed reaches the ranks in ``TORCHDIST_DATA_SHUFFLE_SEED``,
set beside ``TORCHDIST_DATA_DIR``.

As it hands out each batch, it notes the position (epoch, batches handed out) in
:mod:`~airflow_provider_torchdist.spark.node.resume_position`, which ``save_checkpoint`` saves and
``load_latest_checkpoint`` turns into the batches to skip. Runs in the ranks: imports no Airflow.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from airflow_provider_torchdist.spark.node.resume_position import Position, batches_to_skip, note_position

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

#: ``train_data_shuffle_seed`` as the ranks see it (unset: None, rows in order).
SHUFFLE_SEED_ENV = "TORCHDIST_DATA_SHUFFLE_SEED"


def shuffle_seed() -> int | None:
    """The task's ``train_data_shuffle_seed`` (None when unset)."""
    value = os.environ.get(SHUFFLE_SEED_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise RuntimeError(f"{SHUFFLE_SEED_ENV}={value!r} is not an integer >= 0 (train_data_shuffle_seed)")
    return int(value)


def checked_epoch(epoch: Any) -> int:
    """``epoch`` if it is an int >= 0; ``ValueError`` otherwise."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0 (the loop's epoch number), got {epoch!r}")
    return epoch


def epoch_order(rows: int, seed: int | None, epoch: int, rank: int) -> np.ndarray | None:
    """Epoch ``epoch``'s order of a rank's ``rows`` rows (a permutation), or None: in order."""
    if seed is None:
        return None
    import numpy as np

    return np.random.default_rng([seed, epoch, rank]).permutation(rows)


def batch_count(rows: int, batch_size: int, drop_last: bool) -> int:
    """How many batches ``rows`` rows make."""
    return rows // batch_size if drop_last else -(-rows // batch_size)


def epoch_batches(
    table: pa.Table,
    batch_size: int,
    drop_last: bool,
    epoch: int,
    convert: Callable[[pa.Table], dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """Epoch ``epoch``'s batches of ``table`` (each through ``convert``), after those a resume
    skips; the position is noted as each one is handed out."""
    rows = table.num_rows
    seed = shuffle_seed()
    here = Position(epoch, 0, batch_size, drop_last, rows, seed)
    total = batch_count(rows, batch_size, drop_last)
    first = batches_to_skip(here, total)
    order = epoch_order(rows, seed, epoch, int(os.environ.get("RANK", "0")))
    note_position(Position(epoch, first, batch_size, drop_last, rows, seed))
    for index in range(first, total):
        start = index * batch_size
        size = min(batch_size, rows - start)
        # A gather of the shuffled rows: a copy, not a view of the memory map.
        part = table.slice(start, size) if order is None else table.take(order[start : start + size])
        note_position(Position(epoch, index + 1, batch_size, drop_last, rows, seed))
        yield convert(part)
