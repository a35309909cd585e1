"""spark-submit application: start a SparkContext, run an empty 2-task barrier stage, stop.

The floor of any Spark-launched training: JVM start, Python driver, SparkContext, a barrier
stage with its Python workers, shutdown. Uses a bare SparkContext, as this project's driver does
(a SparkSession on top costs about 2 s more here).
"""

from __future__ import annotations

from collections.abc import Iterator

from pyspark import SparkContext


def _empty(_: Iterator[int]) -> Iterator[int]:
    yield 0


def main() -> None:
    sc = SparkContext.getOrCreate()
    sc.parallelize(range(2), 2).barrier().mapPartitions(_empty).collect()
    sc.stop()


if __name__ == "__main__":
    main()
