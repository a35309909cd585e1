"""A DAG for the OpenLineage test: one tiny run whose Spark application writes an event log (to
``$AIRFLOW_HOME/spark-events``, which the test makes), so that the test can read the properties the
running application had. Distributed mode, with one rank: local mode starts no SparkContext. The
OpenLineage settings come from ``[openlineage]``."""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

EVENT_LOG_DIR = Path(os.environ.get("AIRFLOW_HOME", "."), "spark-events")


def train_one_step() -> int:
    return 1


@dag(
    dag_id="torchdist_e2e_openlineage",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist-test"],
)
def openlineage_parent():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_one_step,
        num_processes=1,
        local_mode=False,
        conf={
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": EVENT_LOG_DIR.as_uri(),
            # One plain JSON-lines file (Spark 4 rolls and zstd-compresses event logs by default).
            "spark.eventLog.rolling.enabled": "false",
            "spark.eventLog.compress": "false",
        },
    )


openlineage_parent()
