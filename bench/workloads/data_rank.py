"""What each rank runs in ``bench/data_path.py``: iterate its share of the data set as tensors.

One function per variant; all three touch every value once (a ``sum`` per tensor, so a memory-mapped
page is really read and a lazy path cannot look free), sample the rank's peak anonymous memory, and
return every rank's figures to rank 0 through one gloo ``all_gather_object`` after the timed loop.
Shipped by value (``cloudpickle.register_pickle_by_value``): the ranks cannot import this file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: Sample /proc every this many batches (and once at the end).
SAMPLE_EVERY = 4


def rss_anon_kb() -> int:
    """``RssAnon`` of this process plus its children (a DataLoader's worker processes), in KiB."""
    pids = [os.getpid()]
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1])
                    break
        except OSError:  # a worker that just exited
            pass
    return total


class Meter:
    """Rows, tensor bytes and peak anonymous memory while iterating; the timed window."""

    def __init__(self) -> None:
        import torch

        # torch's first reduction starts its thread pool (most of a second here): a training loop
        # has paid that before its data arrives, so it is paid before the timer starts, in every variant.
        float(torch.ones(1 << 16).sum())
        self.rows = 0
        self.tensor_bytes = 0
        self.batches = 0
        self.checksum = 0.0
        self.peak_kb = rss_anon_kb()
        self.start_kb = self.peak_kb
        self.t0 = time.perf_counter()

    def consume(self, tensors: list[Any]) -> None:
        """Touch every value of one batch (a sum per tensor), count it, sometimes sample memory."""
        self.rows += len(tensors[0])
        for t in tensors:
            self.tensor_bytes += t.numel() * t.element_size()
            self.checksum += float(t.sum())
        self.batches += 1
        if self.batches % SAMPLE_EVERY == 0:
            self.peak_kb = max(self.peak_kb, rss_anon_kb())

    def result(self, **extra: Any) -> dict[str, Any]:
        iter_s = time.perf_counter() - self.t0
        self.peak_kb = max(self.peak_kb, rss_anon_kb())
        return {
            "rank": int(os.environ.get("RANK", "0")),
            "rows": self.rows,
            "tensor_bytes": self.tensor_bytes,
            "batches": self.batches,
            "iter_s": round(iter_s, 3),
            "peak_rss_anon_mb": round(self.peak_kb / 1024, 1),
            "start_rss_anon_mb": round(self.start_kb / 1024, 1),
            "t_iterated": time.time(),
            **extra,
        }


def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's figures, on every rank (after the timed loop, so the collective costs nothing there)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    return sorted(every, key=lambda r: r["rank"])


def iterate_ours(batch_size: int) -> list[dict[str, Any]]:
    """This project's path: ``rank_batches`` over the rank's memory-mapped shard."""
    from airflow_provider_torchdist import rank_batches, rank_shard

    shard = rank_shard()
    arrow_bytes = shard.nbytes
    meter = Meter()
    for batch in rank_batches(batch_size):
        meter.consume(list(batch.values()))
    return gather(meter.result(shard_arrow_bytes=arrow_bytes, record_batches=shard.column(0).num_chunks))


def iterate_pyspark(num_samples: int, batch_size: int) -> list[dict[str, Any]]:
    """PySpark's private path: ``_get_spark_partition_data_loader`` over the partition's Arrow file.

    Its defaults: one DataLoader worker process, rows through pandas ``itertuples`` and the default
    collate (a list of one tensor per column, float columns as float64).
    """
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    meter = Meter()
    for batch in _get_spark_partition_data_loader(num_samples, batch_size):
        meter.consume(list(batch))
    return gather(meter.result())


def iterate_parquet_files(parquet_dir: str, batch_size: int) -> list[dict[str, Any]]:
    """Do it yourself: rank r reads the sorted Parquet files ``files[r::world]`` with pyarrow."""
    import warnings

    import pyarrow.parquet as pq
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    files = sorted(str(p) for p in Path(parquet_dir).glob("*.parquet"))
    mine = files[rank::world]
    meter = Meter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for path in mine:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
                meter.consume([torch.from_numpy(c.to_numpy(zero_copy_only=False)) for c in batch.columns])
    return gather(meter.result(files=len(mine), files_total=len(files)))
