"""The experiment-tracking benchmark's DAGs (``bench/tracking.py``): the same 2-rank training task,
local_mode=True, without and with ``mlflow_conn_id``.

The training function's keyword arguments come from ``BENCH_TRACKING_KWARGS`` (JSON), read when the
DAG is parsed (``dag_run.py`` parses and runs it in one process): where rank 0 writes its result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workloads"))

from tracked_train import train_tracked  # noqa: E402

#: The connection the "on" DAG logs to (``AIRFLOW_CONN_BENCH_MLFLOW``, set by bench/tracking.py).
MLFLOW_CONN_ID = "bench_mlflow"


def _tracking_dag(tracked: bool) -> None:
    @dag(
        dag_id=f"bench_tracking_{'on' if tracked else 'off'}",
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["torchdist", "bench"],
    )
    def bench() -> None:
        TorchDistributorOperator(
            task_id="train",
            train_object=train_tracked,
            kwargs=json.loads(os.environ.get("BENCH_TRACKING_KWARGS", "{}")),
            num_processes=2,
            local_mode=True,
            use_gpu=False,
            mlflow_conn_id=MLFLOW_CONN_ID if tracked else None,
        )

    bench()


_tracking_dag(tracked=False)
# Without the [mlflow] extra the "on" DAG would fail this file's import, and dag_run.py refuses a
# folder with import errors: the launch benchmark's DAGs must not need MLflow.
if importlib.util.find_spec("mlflow") is not None:
    _tracking_dag(tracked=True)
