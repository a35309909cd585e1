"""spark-submit application for ``bench/data_path.py``: make the data set, or write a query to Parquet.

``spark-submit data_spark.py generate OUT ROWS``: ``ROWS`` rows of numeric columns (``id`` bigint,
16 float features ``f0``..``f15`` from ``rand``, an int ``label``) as Parquet in ``OUT``.

``spark-submit data_spark.py write QUERY OUT``: the do-it-yourself route's first step, the query's
result as Parquet in ``OUT``. Prints one ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import json
import time

from pyspark.sql import SparkSession
from pyspark.sql.functions import col, rand

FEATURES = 16


def generate(spark: SparkSession, out: str, rows: int) -> dict:
    df = spark.range(rows).select(
        col("id"),
        *[rand(seed=i).cast("float").alias(f"f{i}") for i in range(FEATURES)],
        (rand(seed=1000) > 0.5).cast("int").alias("label"),
    )
    df.write.mode("overwrite").parquet(out)
    return {"rows": rows, "columns": df.columns}


def write(spark: SparkSession, query: str, out: str) -> dict:
    spark.sql(query).write.mode("overwrite").parquet(out)
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate")
    g.add_argument("out")
    g.add_argument("rows", type=int)
    w = sub.add_parser("write")
    w.add_argument("query")
    w.add_argument("out")
    args = parser.parse_args()
    spark = SparkSession.builder.getOrCreate()
    t0 = time.time()
    done = (
        generate(spark, args.out, args.rows)
        if args.what == "generate"
        else write(spark, args.query, args.out)
    )
    t_done = time.time()
    spark.stop()
    print("RESULT " + json.dumps({**done, "spark_s": t_done - t0, "t_done": t_done}), flush=True)


if __name__ == "__main__":
    main()
