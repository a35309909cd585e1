"""``train_data`` when every Spark task runs on the ranks' machine: pieces on the shared disk, no shuffle.

With a ``local[...]`` or ``local-cluster[...]`` master the executors, the driver and every rank share
one machine and so one filesystem. The tasks that compute the rows then write their partition
straight into the run's staging directory, one Arrow file per partition (a *piece*), and return
only its row count. The counts make the plan (:class:`~.shard_plan.ShardPlan`), and:

- without a seed, each rank's rows are a contiguous run of the pieces, so the driver writes only a
  manifest (``shards.json``: which rows of which pieces are whose), and a rank maps its slices of the
  pieces (:func:`.rank_data.rank_shard`): nothing is copied after the tasks wrote the pieces;
- with a seed, the driver deals the pieces' rows into one file per rank (one pass, one copy).

Compared with the shuffle (:mod:`.data_shards`), this saves the shuffle's write and read, the blobs'
trip back into the JVM, the barrier tasks' second conversion and the row-count job; and since the
rows are written once, the query need not give the same rows twice. What it still pays is Spark's
conversion of rows to Arrow for the Python tasks, which is most of its time.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.data.rank_data import MANIFEST
from airflow_provider_torchdist.spark.data.shard_files import ShardWriter
from airflow_provider_torchdist.spark.data.shard_plan import ShardPlan, TrainDataError

#: What the tasks return for their partition: its number, rows, and piece file (empty: no rows).
PIECE_SCHEMA = "partition long, rows long, piece string"
#: A Spark master whose executors run on the driver's machine.
_SAME_HOST_MASTER = re.compile(r"local(-cluster)?(\[.*\])?")


def same_host(master: str) -> bool:
    """Whether ``master`` runs every executor on the driver's machine (``local[4]``, ``local-cluster[...]``)."""
    return _SAME_HOST_MASTER.fullmatch(master.strip()) is not None


def piece_name(partition: int, attempt: int = 0) -> str:
    """A task attempt's file for its partition: per attempt, so that a speculative or zombie attempt
    finishing late never replaces the file of the attempt whose count Spark returned."""
    return f"piece-{partition:06d}-{attempt}.arrow"


def write_pieces(df: Any, schema: Any, directory: Path) -> list[tuple[int, int, str]]:
    """Run ``df`` once; each task writes its partition's rows into ``directory`` as one Arrow file.

    Returns ``(partition, rows, piece file name)`` for every partition, in partition order.
    """
    target = str(directory)

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId()
        name = piece_name(partition, ctx.attemptNumber())
        # Per attempt, then renamed: a retried task never mixes its rows with a failed attempt's.
        partial = os.path.join(target, f".{name}.{ctx.attemptNumber()}")
        writer = ShardWriter(target, [], schema, files={partition: partial})
        try:
            for batch in batches:
                writer.add(partition, batch)
            writer.close()
        except BaseException as exc:
            writer.abandon()
            if isinstance(exc, OSError):
                raise OSError(exc.errno, f"cannot write a train_data piece into {target}: {exc}") from exc
            raise
        rows = writer.rows[partition]
        if rows:
            os.replace(partial, os.path.join(target, name))
        else:
            os.unlink(partial)
        yield pa.RecordBatch.from_pydict(
            {"partition": [partition], "rows": [rows], "piece": [name if rows else ""]},
            schema=pa.schema([("partition", pa.int64()), ("rows", pa.int64()), ("piece", pa.string())]),
        )

    found = {
        int(r["partition"]): (int(r["rows"]), str(r["piece"]))
        for r in df.mapInArrow(write, PIECE_SCHEMA).collect()
    }
    return [(p, *found[p]) for p in range(len(found))]


def slices(plan: ShardPlan, pieces: list[tuple[int, int, str]]) -> dict[int, list[tuple[str, int, int]]]:
    """Without a seed: each rank's ``(piece, offset, rows)`` runs, in the query's order."""
    starts = list(itertools.accumulate(plan.sizes, initial=0))
    runs: dict[int, list[tuple[str, int, int]]] = {r: [] for r in range(plan.world_size)}
    for (_, rows, name), offset in zip(pieces, plan.offsets, strict=True):
        # The ranks whose runs overlap this piece's rows [offset, offset + rows).
        for rank in range(max(bisect.bisect_right(starts, offset) - 1, 0), plan.world_size):
            lo, hi = max(offset, starts[rank]), min(offset + rows, starts[rank + 1])
            if starts[rank] >= offset + rows:
                break
            if lo < hi:
                runs[rank].append((name, lo - offset, hi - lo))
    return runs


def deal_seeded(plan: ShardPlan, pieces: list[tuple[int, int, str]], schema: Any, directory: Path) -> None:
    """With a seed: one pass over the pieces, each row copied into its rank's file."""
    import numpy as np
    import pyarrow as pa

    writer = ShardWriter(directory, range(plan.world_size), schema, dict(enumerate(plan.sizes)))
    try:
        for (_, rows, name), offset in zip(pieces, plan.offsets, strict=True):
            if not rows:
                continue
            table = pa.ipc.open_file(pa.memory_map(str(directory / name), "r")).read_all()
            ranks = plan.ranks_of(np.arange(offset, offset + rows, dtype=np.int64))
            for rank in np.unique(ranks[ranks >= 0]).tolist():
                for batch in table.filter(pa.array(ranks == rank)).to_batches():
                    writer.add(rank, batch)
            (directory / name).unlink()  # its rows are in the ranks' files now: free the disk early
    finally:
        writer.close()
    writer.check_complete()


def same_host_shards(df: Any, spec: Any, schema: Any, directory: Path, say: Any) -> Path:
    """Every rank's rows of ``df`` in ``directory``: pieces and a manifest, or (seeded) rank files."""
    directory.mkdir(mode=0o700, exist_ok=True)
    pieces = write_pieces(df, schema, directory)
    plan = ShardPlan(
        tuple(rows for _, rows, _ in pieces),
        spec.num_processes,
        spec.train_data_keep_remainder,
        spec.train_data_shuffle_seed,
    )
    say(plan.describe())
    if plan.seed is not None:
        deal_seeded(plan, pieces, schema, directory)
        return directory
    runs = slices(plan, pieces)
    # A rank without rows (more ranks than rows) gets an empty file of the query's columns.
    ShardWriter(directory, [r for r, parts in runs.items() if not parts], schema).close()
    manifest = {"ranks": {str(r): parts for r, parts in runs.items() if parts}}
    partial = directory / f".{MANIFEST}"
    partial.write_text(json.dumps(manifest))
    os.replace(partial, directory / MANIFEST)
    return directory


__all__ = ["TrainDataError", "same_host", "same_host_shards"]
