"""DAGs for the run-lifetime tests: a run that outlives its task, or does not, as it is told to.

Training is gated on files the test controls, never on sleeps. The run's ``conf`` names a
directory shared with the test (``{"gate_dir": "/tmp/..."}``); each rank

1. appends its pid to ``<gate_dir>/started-<rank>`` (one line per start: the test counts them,
   so a run trained twice shows),
2. prints ``before-gate rank R`` and reports a metric,
3. writes its pid to ``<gate_dir>/training-<rank>`` and waits, polling every 0.1 s, until
   ``<gate_dir>/release`` exists,
4. prints ``after-gate rank R``, reports a metric, and returns (rank 0:
   ``{"trained": True, "world": 2}``).

The DAGs, all ``num_processes=2`` on the embedded Spark master in distributed mode:

- ``lifetime_nondurable``: ``durable=False``, no retry: the run ends with its task;
- ``lifetime_durable``: ``durable=True``, one retry, which reattaches; ``check`` reads the result;
- ``lifetime_no_owner``: ``durable=True``, no retry, ``reattach_timeout`` from the conf
  (``{"reattach_timeout": 5}``): nobody comes back, the run tears itself down;
- ``lifetime_deferrable``: ``deferrable=True``: the triggerer waits for the run; ``check`` reads
  the result;
- ``lifetime_locked``: ``durable=True``, one retry, ``reattach_timeout`` from the conf (default
  120): the test deletes the run's record between the tries, so the retry submits afresh beside
  the live run and must be refused by the checkpoint lock;
- ``lifetime_connect_deferrable`` and ``lifetime_connect_durable``: as ``lifetime_deferrable`` and
  ``lifetime_durable`` (3 s retry delay), over the ``torchdist_connect_lifetime`` connection
  (``spark_connect``, to the test session's Connect server, which
  tests/integration/test_connect_lifetime.py creates in the deployment): the ranks run in the
  Connect server's Python workers, while the run's supervisor runs the Connect driver.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output

START = pendulum.datetime(2026, 1, 1, tz="UTC")
#: The gate directory, from the run's conf (rendered into the callable's keyword arguments).
GATE_DIR = "{{ dag_run.conf['gate_dir'] }}"


def train_gated(gate_dir: str) -> dict[str, Any] | None:
    """Wait at the gate (see the module docstring); rank 0 returns a small dict."""
    import os
    import time
    from pathlib import Path

    from airflow_provider_torchdist import report

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gate = Path(gate_dir)
    with open(gate / f"started-{rank}", "a") as started:
        started.write(f"{os.getpid()}\n")
    print(f"before-gate rank {rank}", flush=True)
    report(step=0, gate_open=0)
    (gate / f"training-{rank}").write_text(str(os.getpid()))
    while not (gate / "release").exists():
        time.sleep(0.1)
    print(f"after-gate rank {rank}", flush=True)
    report(step=1, gate_open=1)
    return {"trained": True, "world": world} if rank == 0 else None


def gated_training(**settings: Any) -> TorchDistributorOperator:
    return TorchDistributorOperator(
        task_id="train",
        train_object=train_gated,
        kwargs={"gate_dir": GATE_DIR},
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        **settings,
    )


@task
def check(value: Any) -> dict[str, Any]:
    """Rank 0's result, as a downstream task reads it (plain JSON: in XCom as itself, unsigned)."""
    result = load_output(value)
    assert result == {"trained": True, "world": 2}, result
    return result


@dag(dag_id="lifetime_nondurable", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def lifetime_nondurable():
    gated_training(durable=False, retries=0)


@dag(dag_id="lifetime_durable", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def lifetime_durable():
    trained = gated_training(durable=True, retries=1, retry_delay=timedelta(seconds=3))
    check(trained.output)


@dag(dag_id="lifetime_no_owner", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def lifetime_no_owner():
    gated_training(
        durable=True,
        reattach_timeout="{{ dag_run.conf.get('reattach_timeout', 30) }}",
        retries=0,
    )


@dag(dag_id="lifetime_deferrable", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def lifetime_deferrable():
    trained = gated_training(deferrable=True, retries=0)
    check(trained.output)


@dag(dag_id="lifetime_locked", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def lifetime_locked():
    gated_training(
        durable=True,
        reattach_timeout="{{ dag_run.conf.get('reattach_timeout', 120) }}",
        retries=1,
        retry_delay=timedelta(seconds=1),
    )


lifetime_nondurable()
lifetime_durable()
lifetime_no_owner()
lifetime_deferrable()
lifetime_locked()


CONNECT_CONN_ID = "torchdist_connect_lifetime"


@dag(
    dag_id="lifetime_connect_deferrable",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=["torchdist-test"],
)
def lifetime_connect_deferrable():
    trained = gated_training(conn_id=CONNECT_CONN_ID, deferrable=True, retries=0)
    check(trained.output)


@dag(
    dag_id="lifetime_connect_durable", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"]
)
def lifetime_connect_durable():
    trained = gated_training(
        conn_id=CONNECT_CONN_ID, durable=True, retries=1, retry_delay=timedelta(seconds=3)
    )
    check(trained.output)


lifetime_connect_deferrable()
lifetime_connect_durable()
