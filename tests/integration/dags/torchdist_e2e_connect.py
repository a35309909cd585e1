"""A DAG that trains over Spark Connect from a thin Airflow worker: no full pyspark, no Java, no torch.

``torchdist_e2e_connect`` (run by tests/integration/test_connect_thin.py with ``airflow dags test``
in ./.venv-thin, built by scripts/thin-worker-env):

- ``environment`` checks, from inside the task, that the worker is thin: ``java`` is not on PATH,
  ``pyspark`` is importable (``pyspark-client``, which the Spark provider pulls) but has no
  ``jars`` folder (no full pyspark), and ``torch`` is not installed. It returns what it saw:
  ``{"python": sys.executable, "java": None, "pyspark": <its folder>, "jars": False, "torch": False}``;
- ``train`` runs over the ``torchdist_connect`` connection (``spark_connect``, to the test's server):
  two ranks in the server's executors (which have torch) all-reduce a tensor over gloo, and rank 0
  returns ``{"rank": 0, "world_size": 2, "ranks": (1.0, 2.0)}``; the tuple is not JSON, so it
  travels as a signed cloudpickle envelope, which the thin worker loads without torch;
- ``check`` loads the value with ``load_output`` (bound to this run) and returns
  ``{"rank": 0, "world_size": 2, "ranks": [1.0, 2.0], "type": "tuple"}``, failing when it is wrong.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output

START = pendulum.datetime(2026, 1, 1, tz="UTC")
CONN_ID = "torchdist_connect"


def all_reduce_ranks() -> dict[str, Any]:
    """Each rank puts ``rank + 1`` in its slot; the all-reduce gives every rank all of them."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ranks = torch.zeros(world_size)
    ranks[rank] = rank + 1
    dist.all_reduce(ranks)
    dist.destroy_process_group()
    # Plain Python: the Airflow worker that loads it has no torch.
    return {"rank": rank, "world_size": world_size, "ranks": tuple(ranks.tolist())}


@dag(dag_id="torchdist_e2e_connect", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def torchdist_e2e_connect():
    @task
    def environment() -> dict[str, Any]:
        import importlib.util
        import shutil
        import sys
        from pathlib import Path

        java = shutil.which("java")
        assert java is None, f"java is on this worker's PATH: {java}"
        spec = importlib.util.find_spec("pyspark")
        assert spec is not None and spec.origin, "pyspark (pyspark-client) is not importable"
        import pyspark

        folder = Path(pyspark.__file__).parent
        jars = folder / "jars"
        assert not jars.exists(), f"{jars} exists: this worker has the full pyspark"
        assert importlib.util.find_spec("torch") is None, "torch is installed on this worker"
        return {
            "python": sys.executable,
            "java": java,
            "pyspark": str(folder),
            "jars": jars.exists(),
            "torch": False,
        }

    trained = TorchDistributorOperator(
        task_id="train",
        conn_id=CONN_ID,
        train_object=all_reduce_ranks,
        num_processes=2,
        local_mode=False,
    )

    @task
    def check(value: Any, dag_run=None) -> dict[str, Any]:
        import importlib.util

        result = load_output(value, expect={"dag_id": dag_run.dag_id, "run_id": dag_run.run_id})
        assert isinstance(result["ranks"], tuple), result  # came through the cloudpickle envelope
        assert (result["rank"], result["world_size"], result["ranks"]) == (0, 2, (1.0, 2.0)), result
        assert importlib.util.find_spec("torch") is None  # loading it needed no torch
        return {
            "rank": result["rank"],
            "world_size": result["world_size"],
            "ranks": list(result["ranks"]),
            "type": type(result["ranks"]).__name__,
        }

    environment() >> trained
    check(trained.output)


torchdist_e2e_connect()
