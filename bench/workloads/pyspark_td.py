"""spark-submit application: PySpark's own ``TorchDistributor`` running the trivial workload.

``spark-submit --master local[2] pyspark_td.py --local|--distributed``. Prints one ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddp_trivial  # noqa: E402
from pyspark import cloudpickle  # noqa: E402
from pyspark.ml.torch.distributor import TorchDistributor  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

# The workload module is not importable where the ranks run: ship it by value, as our hook does.
cloudpickle.register_pickle_by_value(ddp_trivial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    args = parser.parse_args()
    spark = SparkSession.builder.getOrCreate()
    t_run = time.time()
    value = TorchDistributor(num_processes=2, local_mode=args.local, use_gpu=False).run(ddp_trivial.train)
    t_done = time.time()
    assert value["world_size"] == 2 and value["allreduce"] == 3.0, value
    print("RESULT " + json.dumps({"value": value, "run_s": t_done - t_run}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
