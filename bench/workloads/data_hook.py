"""``bench/data_path.py``'s variants through this project's hook (a fresh interpreter per sample).

``python data_hook.py ours QUERY BATCH_SIZE``: ``TorchDistributorHook(num_processes=2,
train_data=QUERY).run(fn)``, ``fn`` iterating ``rank_batches(BATCH_SIZE)``; timed from the
``hook.run`` call to its return.

``python data_hook.py connect QUERY BATCH_SIZE --conn-id ID``: the same over the Spark Connect
connection ``ID``; also says the peak RSS of this process and of its Connect driver.

``python data_hook.py diy QUERY BATCH_SIZE OUT``: do it yourself. spark-submit writes the query's
result as Parquet to ``OUT``, then ``TorchDistributorHook(num_processes=2).run(fn)``, rank r reading
the sorted files ``files[r::2]`` with pyarrow; timed from the spark-submit fork to ``hook.run``'s
return. Prints one ``RESULT`` line with every rank's figures.

``--cluster JSON`` (ours, shuffle, diy): on a Spark cluster instead of the embedded master, JSON being
``{"conn_id", "master", "conf", "env"}``: the hooks use the connection (``ours`` as it is configured,
with its ``shared-dir``; ``shuffle`` with ``spark.torchdist.trainData.route=shuffle``), the DIY
spark-submit the master, and all of them the Spark settings and environment (the driver's address).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    parser.add_argument("variant", choices=["ours", "shuffle", "connect", "diy"])
    parser.add_argument("query")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--conn-id", help="connect: the spark_connect connection to the server")
    parser.add_argument("--cluster", type=json.loads, help="a Spark cluster to run on (module docstring)")
    args = parser.parse_args()
    timing: dict[str, float] = {}
    cluster = args.cluster or {}
    on = (
        {"conn_id": cluster["conn_id"], "conf": cluster["conf"], "env_vars": cluster["env"]}
        if cluster
        else {}
    )
    if cluster:
        os.environ.update(cluster["env"])  # the DIY spark-submit's driver too
    if args.variant in ("ours", "shuffle"):
        if args.variant == "shuffle":
            on["conf"] = {**on.get("conf", {}), "spark.torchdist.trainData.route": "shuffle"}
        hook = TorchDistributorHook(
            num_processes=NUM_PROCESSES, local_mode=False, train_data=args.query, **on
        )
        t_start = time.time()
        ranks = hook.run(data_rank.iterate_ours, args.batch_size)
    elif args.variant == "connect":
        # The Connect server's session runs the query; the rows go from its shuffle to the ranks on
        # its executors, never through this process or its Connect driver (a child, so its peak
        # RSS is RUSAGE_CHILDREN's).
        hook = TorchDistributorHook(conn_id=args.conn_id, num_processes=NUM_PROCESSES, train_data=args.query)
        t_start = time.time()
        ranks = hook.run(data_rank.iterate_ours, args.batch_size)
        timing["client_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        timing["driver_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    else:
        if not args.out:
            parser.error("diy needs OUT, the Parquet directory to write")
        t_start = time.time()
        where = {"master": cluster["master"], "conf": cluster["conf"]} if cluster else {}
        cmd = spark_submit_cmd(WORKLOADS / "data_spark.py", "write", args.query, args.out, **where)
        written = subprocess.run(cmd, capture_output=True, text=True)
        if written.returncode != 0:
            sys.exit(f"writing Parquet failed:\n{written.stdout[-3000:]}\n{written.stderr[-3000:]}")
        timing["t_written"] = time.time()
        hook = TorchDistributorHook(num_processes=NUM_PROCESSES, local_mode=False, **on)
        ranks = hook.run(data_rank.iterate_parquet_files, args.out, args.batch_size)
    t_done = time.time()
    print(
        "RESULT " + json.dumps({"ranks": ranks, "t_start": t_start, "t_done": t_done, **timing}), flush=True
    )


if __name__ == "__main__":
    main()
