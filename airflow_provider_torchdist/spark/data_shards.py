"""``train_data`` on the Spark side: the DataFrame, which rank gets which row, and the shard files.

The driver builds the DataFrame (a query, a table, or the user's ``fn(spark)``) and counts its rows
per partition, a small job that runs in the JVM. That fixes every row's global index (its
partition's offset plus its place in the partition), and the index alone decides its rank
(:class:`ShardPlan`): the same rows go to the same ranks whatever the partition count, on every
retry, and every rank gets the same number of rows unless ``train_data_keep_remainder``.

- **Distributed mode**: the executors that compute the rows tag each with its rank and Spark's
  shuffle brings each node's rows to the partition its barrier task reads (:func:`node_partitions`:
  a key per node whose hash lands in that node's partition). The task writes them into one Arrow
  file per rank on its own disk before torchrun starts; nothing passes through the driver.
- **Local mode**: the ranks run on the driver's machine, so the rows come to it, one partition at a
  time, as Arrow IPC bytes (``toLocalIterator``), into files in the run's staging directory.

Ranks find their file through ``TORCHDIST_DATA_DIR`` (:mod:`.rank_data` reads it). A query must
be deterministic (the same rows, in the same order, per partition each time it runs): the shard
job checks every partition's count against the plan and fails, saying so, when it differs.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.jobspec import JobSpec
from airflow_provider_torchdist.spark.rank_data import DATA_DIR_ENV, shard_file
from airflow_provider_torchdist.spark.spark_context import first_line, stop_spark

#: The columns the shard jobs add (and drop again before writing).
RANK_COL, KEY_COL = "__torchdist_rank", "__torchdist_key"
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


def build_dataframe(spark: Any, spec: JobSpec, staging: Path) -> Any:
    """The DataFrame ``train_data`` stands for; raises :class:`TrainDataError` with Spark's error."""
    from pyspark.sql import DataFrame

    try:
        if spec.data_file:
            import cloudpickle

            # Written by the hook into this run's private staging directory (0600), not received.
            with open(staging / spec.data_file, "rb") as f:
                fn = cloudpickle.load(f)["fn"]
            df = fn(spark)
            if not isinstance(df, DataFrame):
                raise TrainDataError(
                    f"train_data's callable returned {type(df).__name__}, not a pyspark DataFrame"
                )
        elif is_table_name(spec.train_data or ""):
            df = spark.table(spec.train_data)
        else:
            df = spark.sql(spec.train_data)
        from pyspark.sql.pandas.types import to_arrow_schema

        to_arrow_schema(df.schema)  # a column type Arrow cannot carry fails here, named
    except TrainDataError:
        raise
    except Exception as exc:
        raise TrainDataError(f"train_data failed before training: {first_line(exc)}") from None
    return df


def plan_shards(df: Any, spec: JobSpec, world_size: int) -> ShardPlan:
    """Count the rows of each partition (one job, in the JVM) and make the plan."""
    from pyspark.sql.functions import spark_partition_id

    try:
        rows = df.select(spark_partition_id().alias("p")).groupBy("p").count().collect()
    except Exception as exc:
        raise TrainDataError(f"train_data failed before training: {first_line(exc)}") from None
    found = {int(r["p"]): int(r["count"]) for r in rows}
    counts = tuple(found.get(p, 0) for p in range(df.rdd.getNumPartitions()))
    return ShardPlan(counts, world_size, spec.train_data_keep_remainder, spec.train_data_shuffle_seed)


def with_ranks(df: Any, plan: ShardPlan) -> Any:
    """``df`` with each row's rank in ``RANK_COL``; dropped rows left out. Runs on the executors."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    schema = StructType([*df.schema.fields, StructField(RANK_COL, IntegerType(), False)])

    def tag(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        start = next_index = plan.offsets[partition]
        for batch in batches:
            indexes = np.arange(next_index, next_index + batch.num_rows, dtype=np.int64)
            next_index += batch.num_rows
            ranks = plan.ranks_of(indexes)
            tagged = pa.RecordBatch.from_arrays(
                [*batch.columns, pa.array(ranks)], names=[*batch.schema.names, RANK_COL]
            )
            keep = ranks >= 0
            yield tagged if keep.all() else tagged.filter(pa.array(keep))
        if next_index - start != plan.counts[partition]:
            raise TrainDataError(
                f"train_data is not deterministic: partition {partition} had {plan.counts[partition]} rows "
                f"when counted and {next_index - start} when read again. Make the query return the same "
                "rows each time (no rand() without a seed, no source that changes while the run starts)."
            )

    return df.mapInArrow(tag, schema)


def node_keys(spark: Any, nodes: int) -> list[int]:
    """For each node n, a long key that Spark's hash partitioning into ``nodes`` partitions sends
    to partition n (the same Murmur3 hash, seed 42, that ``repartition(n, col)`` uses)."""
    from pyspark.sql.functions import col, hash, lit, pmod

    found: dict[int, int] = {}
    probe = 0
    while len(found) < nodes:
        ids = spark.range(probe, probe + 64 * nodes).select(
            "id", pmod(hash(col("id")), lit(nodes)).alias("p")
        )
        for row in ids.collect():
            found.setdefault(int(row["p"]), int(row["id"]))
        probe += 64 * nodes
    return [found[n] for n in range(nodes)]


def node_partitions(spark: Any, ranked: Any, nodes: int, nproc_per_node: int) -> Any:
    """``ranked`` shuffled so that partition n holds exactly node n's rows (its ranks'
    ``n * nproc_per_node`` to ``(n + 1) * nproc_per_node - 1``)."""
    from pyspark.sql.functions import array as array_of
    from pyspark.sql.functions import col, element_at, lit

    keys = array_of(*[lit(k) for k in node_keys(spark, nodes)])
    node = (col(RANK_COL) / lit(nproc_per_node)).cast("int")
    return ranked.withColumn(KEY_COL, element_at(keys, node + lit(1))).repartition(nodes, KEY_COL)


class ShardWriter:
    """Writes a stream of tagged batches into one Arrow file per rank, without the helper columns.

    Spark hands over batches of 10,000 rows; a rank's ``rank_batches`` is zero-copy only within one
    record batch, so the writer joins them into record batches of about ``FLUSH_BYTES`` first.
    """

    FLUSH_BYTES = 64 << 20

    def __init__(self, directory: str | Path, ranks: Iterable[int], schema: Any) -> None:
        import pyarrow as pa

        self.directory = Path(directory)
        self._schema = schema
        self._files = {r: pa.OSFile(str(shard_file(directory, r)), "wb") for r in ranks}
        self._writers = {r: pa.ipc.new_file(f, schema) for r, f in self._files.items()}
        self._pending: dict[int, list[Any]] = {r: [] for r in self._writers}
        self._pending_bytes = dict.fromkeys(self._writers, 0)
        #: Rows written per rank.
        self.rows = dict.fromkeys(self._writers, 0)

    def _add(self, rank: int, part: Any) -> None:
        self._pending[rank].append(part)
        self._pending_bytes[rank] += part.nbytes
        self.rows[rank] += part.num_rows
        if self._pending_bytes[rank] >= self.FLUSH_BYTES:
            self._flush(rank)

    def _flush(self, rank: int) -> None:
        import pyarrow as pa

        if self._pending[rank]:
            joined = pa.Table.from_batches(self._pending[rank], schema=self._schema).combine_chunks()
            for batch in joined.to_batches():
                self._writers[rank].write_batch(batch)
        self._pending[rank], self._pending_bytes[rank] = [], 0

    def write(self, batch: Any) -> None:
        import pyarrow as pa

        names = [n for n in batch.schema.names if n not in (RANK_COL, KEY_COL)]
        ranks = batch.column(RANK_COL).to_numpy()
        data = pa.RecordBatch.from_arrays([batch.column(n) for n in names], schema=self._schema)
        present = set(ranks.tolist()) if len(ranks) else set()
        for rank in present:
            if rank not in self._writers:
                raise TrainDataError(
                    f"a row for rank {rank} reached a node that holds ranks {sorted(self._writers)}"
                )
            self._add(rank, data if len(present) == 1 else data.filter(pa.array(ranks == rank)))

    def close(self) -> None:
        for rank in self._writers:
            self._flush(rank)
        for writer in self._writers.values():
            writer.close()
        for f in self._files.values():
            f.close()


def arrow_schema(df: Any) -> Any:
    """The Arrow schema of ``df``'s columns, as the shard files hold them."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema)


_NODE_DIR = re.compile(r"torchdist-data-(\d+)-.+")


def new_node_directory() -> str:
    """A private directory for this node's shards. Its name carries this process's PID: a task
    killed before it removed its directory leaves one whose process is dead, which the next node
    on this host (and the Airflow worker's sweep, ``sweep.py``) removes."""
    base = Path(tempfile.gettempdir())
    for entry in base.glob("torchdist-data-*"):
        match = _NODE_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
            try:
                os.kill(int(match[1]), 0)
            except ProcessLookupError:
                remove_directory(entry)
            except OSError:
                pass  # alive, or not ours to signal
    return tempfile.mkdtemp(prefix=f"torchdist-data-{os.getpid()}-")


def write_local_shards(ranked: Any, schema: Any, world_size: int, directory: Path) -> dict[int, int]:
    """Local mode: bring the tagged rows to this machine a partition at a time, as Arrow IPC
    bytes, and write every rank's file; returns the rows written per rank."""
    from pyspark.sql.types import BinaryType, StructField, StructType

    def to_ipc(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for batch in batches:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as stream:
                stream.write_batch(batch)
            yield pa.RecordBatch.from_pydict({"ipc": [sink.getvalue().to_pybytes()]})

    import pyarrow as pa

    directory.mkdir(mode=0o700, exist_ok=True)
    writer = ShardWriter(directory, range(world_size), schema)
    try:
        stream = ranked.mapInArrow(to_ipc, StructType([StructField("ipc", BinaryType(), False)]))
        for row in stream.toLocalIterator(prefetchPartitions=True):
            for batch in pa.ipc.open_stream(row["ipc"]):
                writer.write(batch)
    finally:
        writer.close()
    return writer.rows


def remove_directory(directory: str | Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def data_barrier_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    driver_output_dir: str | None,
    schema: Any,
    batches: Iterator[Any],
) -> Iterator[Any]:
    """The barrier task of a run with ``train_data`` (``mapInArrow(..., barrier=True)``): write this
    node's rows into its ranks' files, then run the node as :func:`.barrier.barrier_task` does.

    A shard that cannot be written (a full disk) is this node's failure, reported with its host.
    """
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    from airflow_provider_torchdist.spark.barrier import barrier_task

    directory = new_node_directory()
    node = BarrierTaskContext.get().partitionId()
    ranks = range(node * spec.nproc_per_node, (node + 1) * spec.nproc_per_node)

    def prepare() -> None:
        try:
            writer = ShardWriter(directory, ranks, schema)
            try:
                for batch in batches:
                    writer.write(batch)
            finally:
                writer.close()  # writes what it still holds: may be what fills the disk
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot write this node's train_data shard into {directory}: {exc}"
            ) from exc
        os.environ[DATA_DIR_ENV] = directory

    try:
        for result in barrier_task(spec, channel_address, driver_output_dir, iter(()), prepare=prepare):
            yield pa.RecordBatch.from_pydict({"result": [result]})
    finally:
        # A reused Python worker must not hand the next task this run's shards.
        os.environ.pop(DATA_DIR_ENV, None)
        remove_directory(directory)


def has_train_data(spec: JobSpec) -> bool:
    return bool(spec.train_data or spec.data_file)


def distributed_shards(sc: Any, spec: JobSpec, staging: Path, say: Any) -> tuple[Any, Any]:
    """The DataFrame whose partition n is node n's rows, and the shard files' schema."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()  # on ``sc``, the driver's context
    df = build_dataframe(spark, spec, staging)
    plan = plan_shards(df, spec, spec.num_processes)
    say(plan.describe())
    return node_partitions(spark, with_ranks(df, plan), spec.num_nodes, spec.nproc_per_node), arrow_schema(df)


def local_shards(spec: JobSpec, staging: Path, say: Any) -> Path:
    """Local mode: every rank's file in ``<staging>/data`` (removed with the staging directory)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()
    directory = staging / "data"
    try:
        df = build_dataframe(spark, spec, staging)
        plan = plan_shards(df, spec, spec.num_processes)
        say(plan.describe())
        write_local_shards(with_ranks(df, plan), arrow_schema(df), spec.num_processes, directory)
    except OSError as exc:
        raise TrainDataError(f"cannot write the train_data shards into {directory}: {exc}") from None
    except TrainDataError:
        raise
    except Exception as exc:
        raise TrainDataError(f"train_data failed before training: {first_line(exc)}") from None
    finally:
        # Spark ran only to read the data: the ranks train on this machine without it.
        stop_spark(spark.sparkContext)
    return directory
