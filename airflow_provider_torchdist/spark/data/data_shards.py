"""``train_data`` on the Spark side: the DataFrame, and each rank's rows brought to its node.

When every Spark task runs on the ranks' machine (a ``local[...]`` master), or every node and the
driver mount one directory (:data:`SHARED_DIR_CONF`, the connection's ``shared-dir``), the tasks
write the rows where the ranks read them (:mod:`.same_host_shards`, :func:`on_shared_disk`).
Otherwise:

The driver builds the DataFrame (a query, a table, or the user's ``fn(spark)``) and counts its rows
per partition, a small job that runs in the JVM. That fixes every row's global index (its
partition's offset plus its place in the partition), and the index alone decides its rank
(:class:`~.shard_plan.ShardPlan`): the same rows go to the same ranks whatever the partition count,
on every retry, and every rank gets the same number of rows unless ``train_data_keep_remainder``.

The tasks that compute the rows apply the plan (:func:`rank_blobs`) and pack each rank's rows into
Arrow IPC streams of about 256 KB (:class:`~.shard_files.BlobPacker`). Then:

- **distributed mode**: Spark's shuffle brings each node's blobs to the partition its barrier task
  reads (:func:`node_keys`: a key per node whose hash lands in that node's partition), and the task
  writes them into one Arrow file per rank on its own disk before torchrun starts. Nothing passes
  through the driver, and the shuffle moves large binary values, not rows to convert.
- **local mode**: the ranks run on the driver's machine, so the blobs come to it, a partition at a
  time (``toLocalIterator``), into files in the run's staging directory.

Ranks find their file through ``TORCHDIST_DATA_DIR`` (:mod:`.rank_data`). A query must be
deterministic (the same rows, in the same order, per partition each time it runs): the tasks check
every partition's count against the plan, and the nodes every rank's, and fail saying so.
"""

# size: train_data's driver side, its routes side by side (shared disk, shuffle, local), each
# short: about 320 lines, kept whole.

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.data.rank_data import DATA_DIR_ENV
from airflow_provider_torchdist.spark.data.same_host_shards import same_host, same_host_shards
from airflow_provider_torchdist.spark.data.shard_files import (
    BlobPacker,
    ShardWriter,
    write_blobs,
)
from airflow_provider_torchdist.spark.data.shard_plan import ShardPlan, TrainDataError, is_table_name
from airflow_provider_torchdist.spark.driver.spark_context import first_line, stop_spark
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

__all__ = [
    "DATA_DIR_ENV",
    "TrainDataError",
    "distributed_shards",
    "has_train_data",
    "local_shards",
    "remove_shards",
]

#: The blobs' schema: the node's shuffle key, the rank, an Arrow IPC stream of its rows.
BLOB_SCHEMA = "key long, rank int, ipc binary"
#: Blobs of about this size, unless the Arrow batches of BLOB_SCHEMA would pass 2 GB (below).
BLOB_BYTES = 256 << 10


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
            df = spark.sql(spec.train_data, args=spec.train_data_args or None)  # bound, not spliced
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
    counts = tuple(found.get(p, 0) for p in range(_partitions(df, found)))
    return ShardPlan(counts, world_size, spec.train_data_keep_remainder, spec.train_data_shuffle_seed)


def _partitions(df: Any, counted: dict[int, int]) -> int:
    """``df``'s partition count; over Spark Connect (no RDD API), up to the last one that holds rows
    (:meth:`~.shard_plan.ShardPlan.partition` gives any later one none)."""
    if type(df).__module__.startswith("pyspark.sql.connect"):
        return max(counted, default=-1) + 1
    return df.rdd.getNumPartitions()


def blob_bytes(spark: Any) -> int:
    """The blob size: Spark hands the barrier task ``maxRecordsPerBatch`` blobs per Arrow batch,
    whose binary column must stay under 2 GB."""
    per_batch = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
    if per_batch <= 0:
        return 64 << 10
    return max(16 << 10, min(BLOB_BYTES, (1 << 30) // per_batch))


def rank_blobs(df: Any, plan: ShardPlan, keys: list[int], nproc_per_node: int, size: int) -> Any:
    """``df``'s rows as blobs per rank (``BLOB_SCHEMA``), made by the tasks that compute the rows;
    ``keys[n]`` is node n's shuffle key; dropped rows are left out."""

    def pack(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        start, expected = plan.partition(partition)
        next_index = start
        packer = BlobPacker(size)

        def rows(blobs: Iterator[tuple[int, bytes]]) -> Iterator[Any]:
            for rank, blob in blobs:
                yield pa.RecordBatch.from_pydict(
                    {"key": [keys[rank // nproc_per_node]], "rank": [rank], "ipc": [blob]},
                    schema=pa.schema([("key", pa.int64()), ("rank", pa.int32()), ("ipc", pa.binary())]),
                )

        for batch in batches:
            ranks = plan.ranks_of(np.arange(next_index, next_index + batch.num_rows, dtype=np.int64))
            next_index += batch.num_rows
            present = np.unique(ranks)
            for rank in present[present >= 0].tolist():
                part = batch if len(present) == 1 else batch.filter(pa.array(ranks == rank))
                yield from rows(packer.add(rank, part))
        yield from rows(packer.flush())
        if next_index - start != expected:
            raise TrainDataError(
                f"train_data is not deterministic: partition {partition} had {expected} rows "
                f"when counted and {next_index - start} when read again. Make the query return the same "
                "rows each time (no rand() without a seed, no source that changes while the run starts)."
            )

    return df.mapInArrow(pack, BLOB_SCHEMA)


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


def arrow_schema(df: Any) -> Any:
    """The Arrow schema of ``df``'s columns, as the shard files hold them."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema)


def has_train_data(spec: JobSpec) -> bool:
    return bool(spec.train_data or spec.data_file)


#: Spark setting: ``shuffle`` moves the rows with Spark's shuffle even when every task runs on the
#: ranks' machine (``auto``, the default, writes them there: :mod:`.same_host_shards`).
ROUTE_CONF = "spark.torchdist.trainData.route"
#: Spark setting: a directory that the driver and every node mount at this path (NFS, Lustre, ...),
#: where the executors' user may write. On a cluster the tasks then write the rows into a directory
#: of the run's there, instead of Spark's shuffle bringing them to the nodes. The connection's
#: ``shared-dir`` extra sets it.
SHARED_DIR_CONF = "spark.torchdist.trainData.sharedDir"


def shard_directory(sc: Any, staging: Path, run_id: str) -> Path | None:
    """Where the tasks that compute the rows write them for the ranks: the staging directory when
    every task runs on this machine, else the run's directory in the shared one; None for the shuffle."""
    conf = sc.getConf()
    route = conf.get(ROUTE_CONF, "auto").strip().lower()
    if route not in ("auto", "shuffle"):
        raise TrainDataError(f"{ROUTE_CONF} must be 'auto' or 'shuffle', got {route!r}")
    shared = (conf.get(SHARED_DIR_CONF, "") or "").strip()
    if route == "shuffle":
        return None
    if same_host(sc.master):
        return staging / "data"
    if not shared:
        return None
    if not os.path.isabs(shared) or not os.path.isdir(shared):
        raise TrainDataError(
            f"{SHARED_DIR_CONF} must be a directory that the driver and every node mount at the same "
            f"absolute path; {shared!r} is {'not absolute' if not os.path.isabs(shared) else 'not a directory here'}"
        )
    return Path(shared, f"torchdist-rows-{run_id}")


def remove_shards(shards: Any, staging: Path) -> None:
    """After the run: a shared directory's run directory goes (the staging directory's goes with it)."""
    if isinstance(shards, Path) and not shards.is_relative_to(staging):
        shutil.rmtree(shards, ignore_errors=True)


def on_shared_disk(spark: Any, spec: JobSpec, staging: Path, directory: Path, say: Any) -> Path:
    """Every rank's rows in ``directory``, written there by the tasks (it is on every node's disk)."""
    df = build_dataframe(spark, spec, staging)
    if not directory.is_relative_to(staging):
        try:  # a new directory, the run's alone: never one that someone else made beforehand
            directory.mkdir(mode=0o700)
        except OSError as exc:
            raise TrainDataError(f"cannot make the run's train_data directory {directory}: {exc}") from None
    try:
        return same_host_shards(df, spec, arrow_schema(df), directory, say)
    except Exception as exc:
        remove_shards(directory, staging)  # a shared directory keeps nothing of a failed run
        if isinstance(exc, TrainDataError):
            raise
        # A full disk is the task's OSError, as Spark reports it: name the machine and the directory.
        text = str(exc)
        if "cannot write a train_data piece" in text:
            line = next(x for x in text.splitlines() if "cannot write a train_data piece" in x)
            raise TrainDataError(f"on {socket.gethostname()}: {line.strip()}") from None
        if isinstance(exc, OSError):  # the driver's own writes (the directory, the manifest)
            raise TrainDataError(f"cannot write the train_data shards into {directory}: {exc}") from None
        raise TrainDataError(f"train_data failed before training: {first_line(exc)}") from None


def distributed_shards(
    sc: Any, spec: JobSpec, staging: Path, say: Any
) -> tuple[Any, Any, tuple[int, ...]] | Path:
    """Where node n finds its rows: the directory every task shares (:func:`on_shared_disk`), or
    the DataFrame whose partition n holds node n's blobs, the shard files' schema, and the rows
    per rank. A shared directory's run directory is the caller's to remove (:func:`remove_shards`)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()  # on ``sc``, the driver's context
    directory = shard_directory(sc, staging, spec.run_id)
    if directory is not None:
        return on_shared_disk(spark, spec, staging, directory, say)
    return shuffled_shards(spark, spec, staging, say)


def shuffled_shards(spark: Any, spec: JobSpec, staging: Path, say: Any) -> tuple[Any, Any, tuple[int, ...]]:
    """The DataFrame whose partition n holds node n's blobs (Spark's shuffle brings them there),
    the shard files' schema, and the rows per rank: on the driver's session, or over Spark Connect
    on the server's (DataFrame calls only)."""
    df = build_dataframe(spark, spec, staging)
    plan = plan_shards(df, spec, spec.num_processes)
    say(plan.describe())
    keys = node_keys(spark, spec.num_nodes)
    blobs = rank_blobs(df, plan, keys, spec.nproc_per_node, blob_bytes(spark))
    return blobs.repartition(spec.num_nodes, "key"), arrow_schema(df), plan.sizes


def local_shards(spec: JobSpec, staging: Path, say: Any) -> Path:
    """Local mode: every rank's file in ``<staging>/data`` (removed with the staging directory), or
    in the run's directory in a shared one (the caller's to remove: :func:`remove_shards`)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()
    directory = staging / "data"
    try:
        if (shared := shard_directory(spark.sparkContext, staging, spec.run_id)) is not None:
            return on_shared_disk(spark, spec, staging, shared, say)
        df = build_dataframe(spark, spec, staging)
        plan = plan_shards(df, spec, spec.num_processes)
        say(plan.describe())
        directory.mkdir(mode=0o700, exist_ok=True)
        writer = ShardWriter(
            directory, range(spec.num_processes), arrow_schema(df), dict(enumerate(plan.sizes))
        )
        try:
            blobs = rank_blobs(df, plan, [0] * spec.num_processes, 1, blob_bytes(spark))
            write_blobs((_as_batch(row) for row in blobs.toLocalIterator(prefetchPartitions=True)), writer)
        finally:
            writer.close()
        writer.check_complete()
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


def _as_batch(row: Any) -> Any:
    import pyarrow as pa

    return pa.RecordBatch.from_pydict({"rank": [row["rank"]], "ipc": [bytes(row["ipc"])]})
