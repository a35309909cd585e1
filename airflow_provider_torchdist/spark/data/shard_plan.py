"""Which rank gets which row of ``train_data``: the plan the driver makes from the row counts.

Pure (numpy only): the driver makes the plan, the executors that compute the rows apply it.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

#: A bare table identifier (``t``, ``db.t``, ``catalog.db.t``, parts optionally in backticks):
#: anything else is a query.
_TABLE = re.compile(r"`?[A-Za-z_][A-Za-z0-9_]*`?(\.`?[A-Za-z_][A-Za-z0-9_]*`?){0,2}")
#: The largest multiplier of the seeded order, so that ``a * index`` fits in 64 bits.
_MAX_MULTIPLIER = 2**31


class TrainDataError(Exception):
    """``train_data`` could not be read or sharded: said before any rank starts."""


def is_table_name(text: str) -> bool:
    """Whether ``train_data`` names a table (``db.table``) rather than holding a query."""
    return _TABLE.fullmatch(text.strip()) is not None


@dataclass(frozen=True)
class ShardPlan:
    """Which rank gets the row at each global index (its partition's offset + its place in it).

    Without a seed, rank r gets a contiguous run of indexes; with one, the indexes are first put in
    a seeded order (``(a * i + b) mod N`` with ``a`` coprime to N: a permutation, the same on
    every retry). By default every rank gets ``N // world_size`` rows and the last
    ``N % world_size`` of that order are dropped; ``keep_remainder`` gives the first ranks one more.
    """

    counts: tuple[int, ...]
    world_size: int
    keep_remainder: bool = False
    seed: int | None = None
    offsets: tuple[int, ...] = field(init=False)
    sizes: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        offsets, total = [], 0
        for n in self.counts:
            offsets.append(total)
            total += n
        base, extra = divmod(total, self.world_size)
        sizes = [base + (1 if self.keep_remainder and r < extra else 0) for r in range(self.world_size)]
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "sizes", tuple(sizes))

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def dropped(self) -> int:
        return self.total - sum(self.sizes)

    def _order(self) -> tuple[int, int]:
        """``(a, b)`` of the seeded order (``(1, 0)``: the query's order)."""
        n = self.total
        if self.seed is None or n < 2:
            return 1, 0
        rng = random.Random(self.seed)
        while True:
            a = rng.randrange(1, min(n, _MAX_MULTIPLIER))
            if math.gcd(a, n) == 1:
                return a, rng.randrange(n)

    def partition(self, index: int) -> tuple[int, int]:
        """``(offset, rows)`` of partition ``index``. A partition past the counted ones has none: a
        Spark Connect client cannot ask for a DataFrame's partition count, so it counts up to the
        last partition that holds rows."""
        if index < len(self.counts):
            return self.offsets[index], self.counts[index]
        return self.total, 0

    def ranks_of(self, indexes: Any) -> Any:
        """The rank of each global index (a numpy int64 array); -1 for a dropped row."""
        import numpy as np

        a, b = self._order()
        position = indexes if (a, b) == (1, 0) else (indexes * a + b) % self.total
        starts = np.cumsum((0, *self.sizes))
        ranks = np.searchsorted(starts, position, side="right") - 1
        ranks[position >= starts[-1]] = -1
        return ranks.astype(np.int32)

    def describe(self) -> str:
        """The log line: rows, ranks, and what was dropped or kept."""
        sizes = sorted(set(self.sizes))
        each = f"{sizes[0]} rows each" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]} rows"
        order = "in the query's order" if self.seed is None else f"in the order of seed {self.seed}"
        tail = (
            f"; {self.dropped} row(s) dropped so that every rank has the same number "
            "(train_data_keep_remainder=True keeps them)"
            if self.dropped
            else ""
        )
        return (
            f"train_data: {self.total} rows in {len(self.counts)} Spark partition(s) for "
            f"{self.world_size} ranks, {each}, dealt {order}{tail}"
        )
