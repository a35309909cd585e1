"""spark-submit application: variant (a) of ``bench/data_path.py``, PySpark's private DataFrame path.

``spark-submit --master local[2] data_pyspark_td.py QUERY ROWS_PER_RANK BATCH_SIZE``:
``TorchDistributor(num_processes=2, local_mode=False)._train_on_dataframe(fn, df)``, where ``fn``
iterates ``_get_spark_partition_data_loader(ROWS_PER_RANK, BATCH_SIZE)``. That path needs the
DataFrame to have exactly ``num_processes`` partitions (a task per partition becomes a rank), so
the query's result is repartitioned to 2 first, a shuffle that counts in this variant's time.
Prints one ``RESULT`` line with every rank's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data_rank  # noqa: E402
from pyspark import cloudpickle  # noqa: E402
from pyspark.ml.torch.distributor import TorchDistributor  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

# The workload module is not importable where the ranks run: ship it by value, as our hook does.
cloudpickle.register_pickle_by_value(data_rank)

NUM_PROCESSES = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("query")
    parser.add_argument("rows_per_rank", type=int)
    parser.add_argument("batch_size", type=int)
    args = parser.parse_args()
    spark = SparkSession.builder.getOrCreate()
    t_session = time.time()
    df = spark.sql(args.query).repartition(NUM_PROCESSES)
    distributor = TorchDistributor(num_processes=NUM_PROCESSES, local_mode=False, use_gpu=False)
    ranks = distributor._train_on_dataframe(
        data_rank.iterate_pyspark, df, args.rows_per_rank, args.batch_size
    )
    t_done = time.time()
    spark.stop()
    print("RESULT " + json.dumps({"ranks": ranks, "t_session": t_session, "t_done": t_done}), flush=True)


if __name__ == "__main__":
    main()
