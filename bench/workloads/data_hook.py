"""``bench/data_path.py``'s variants through this project's hook (a fresh interpreter per sample).

``python data_hook.py ours QUERY BATCH_SIZE``: ``TorchDistributorHook(num_processes=2,
train_data=QUERY).run(fn)``, ``fn`` iterating ``rank_batches(BATCH_SIZE)``; timed from the
``hook.run`` call to its return.

``python data_hook.py diy QUERY BATCH_SIZE OUT``: do it yourself. spark-submit writes the query's
result as Parquet to ``OUT``, then ``TorchDistributorHook(num_processes=2).run(fn)``, rank r reading
the sorted files ``files[r::2]`` with pyarrow; timed from the spark-submit fork to ``hook.run``'s
return. Prints one ``RESULT`` line with every rank's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data_rank  # noqa: E402
from common import WORKLOADS, spark_submit_cmd  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402

NUM_PROCESSES = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant", choices=["ours", "diy"])
    parser.add_argument("query")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("out", nargs="?")
    args = parser.parse_args()
    timing: dict[str, float] = {}
    if args.variant == "ours":
        hook = TorchDistributorHook(num_processes=NUM_PROCESSES, local_mode=False, train_data=args.query)
        t_start = time.time()
        ranks = hook.run(data_rank.iterate_ours, args.batch_size)
    else:
        if not args.out:
            parser.error("diy needs OUT, the Parquet directory to write")
        t_start = time.time()
        cmd = spark_submit_cmd(WORKLOADS / "data_spark.py", "write", args.query, args.out)
        written = subprocess.run(cmd, capture_output=True, text=True)
        if written.returncode != 0:
            sys.exit(f"writing Parquet failed:\n{written.stdout[-3000:]}\n{written.stderr[-3000:]}")
        timing["t_written"] = time.time()
        hook = TorchDistributorHook(num_processes=NUM_PROCESSES, local_mode=False)
        ranks = hook.run(data_rank.iterate_parquet_files, args.out, args.batch_size)
    t_done = time.time()
    print(
        "RESULT " + json.dumps({"ranks": ranks, "t_start": t_start, "t_done": t_done, **timing}), flush=True
    )


if __name__ == "__main__":
    main()
