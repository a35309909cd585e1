"""A production-shaped deployment: ``scripts/airflow-standalone`` on PostgreSQL, three training
runs at once.

The session's shared deployment (conftest.py) keeps Airflow's metadata in a PostgreSQL cluster of
the session's own (``postgres.py``: a temp dir, a free port on 127.0.0.1); its LocalExecutor runs up
to four tasks at once. Three runs of ``concurrent_training``
(``tests/integration/dags/concurrent_training.py``) are triggered through the REST API together,
each with its own target. The ranks wait at a gate the test opens once all six of them are
training, so the three runs' training overlaps by construction, and the ranks' own timestamps
show it. Each run's result and metrics must be its own, as PostgreSQL recorded them; afterwards
nothing of the runs is left running (the deployment's and PostgreSQL's own stops are checked at the
end of the session).

PostgreSQL is installed by ``scripts/install-postgres`` when missing; the test fails, rather than
skips, when that cannot be done.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.deployment import Deployment, wait_for
from tests.integration.postgres import PostgresServer
from tests.integration.run_processes import alive

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

DAG_ID = "concurrent_training"
#: Each run's target weight: a run's result says which run it came from.
TARGETS = {"a": 1.5, "b": -2.0, "c": 4.0}
RANKS = (0, 1)
#: From the trigger to all six ranks at the gate: three spark-submits start together on a small machine.
GATE_TIMEOUT = 420
RUN_TIMEOUT = 300


def _run_tree(task_pid: int, rank_pids: list[int]) -> dict[int, str]:
    """A run's processes while it trains: its task process, everything under it (spark-submit, the
    driver's JVM, Python workers, torchrun agents...) and its ranks."""
    procs = [psutil.Process(task_pid), *psutil.Process(task_pid).children(recursive=True)]
    procs += [psutil.Process(pid) for pid in rank_pids]
    tree = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            tree[proc.pid] = " ".join(proc.cmdline())[:160]
    return tree


def test_three_runs_train_at_once_on_postgres(
    deployment: Deployment, deployment_postgres: PostgresServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    started = time.monotonic()
    runs = {
        name: deployment.trigger(DAG_ID, {"gate_dir": str(gate), "name": name, "target": target})
        for name, target in TARGETS.items()
    }

    def all_at_gate() -> bool:
        for name, run_id in runs.items():
            if deployment.dag_run(DAG_ID, run_id)["state"] == "failed":
                pytest.fail(f"run {name} failed before training:\n{deployment.run_report(DAG_ID, run_id)}")
        return all((gate / f"training-{name}-{rank}").exists() for name in runs for rank in RANKS)

    try:
        wait_for(all_at_gate, GATE_TIMEOUT, f"the ranks of all three runs at the gate in {gate}", interval=1)
        at_gate = time.monotonic() - started
        # Airflow's side of it: three task instances running at once.
        for name, run_id in runs.items():
            assert deployment.task_instance(DAG_ID, run_id, "train")["state"] == "running", name
        trees = {
            name: _run_tree(
                deployment.task_pid(DAG_ID, run_id, "train"),
                [int((gate / f"training-{name}-{rank}").read_text()) for rank in RANKS],
            )
            for name, run_id in runs.items()
        }
        released = time.time()
        print("processes per run while training:", {name: len(tree) for name, tree in trees.items()})
    finally:
        # Also when the test fails here: the runs then end by themselves, rather than wait at the gate.
        (gate / "release").touch()

    finals = {name: deployment.wait_run(DAG_ID, run_id, timeout=RUN_TIMEOUT) for name, run_id in runs.items()}
    print(f"three runs at the gate after {at_gate:.1f} s, all ended after {time.monotonic() - started:.1f} s")
    for name, final in finals.items():
        assert final["state"] == "success", deployment.run_report(DAG_ID, runs[name])

    spans = []
    for name, run_id in runs.items():
        result = deployment.xcom(DAG_ID, run_id, "train")
        assert result["name"] == name and result["target"] == TARGETS[name], result
        assert result["weight"] == pytest.approx(TARGETS[name], abs=1e-3), result
        assert result["world_size"] == len(RANKS) == len(result["spans"]) and result["epochs"] > 0, result
        spans += result["spans"]
        metrics = deployment.xcom(DAG_ID, run_id, "train", key="metrics")
        for rank in RANKS:
            mine = [m for m in metrics if m["rank"] == rank]
            assert [m["step"] for m in mine] == list(range(result["epochs"])), (name, rank, metrics)
            assert mine[-1]["weight"] == pytest.approx(TARGETS[name], abs=1e-3), (name, rank, mine[-1])
        assert {m["rank"] for m in metrics} == set(RANKS), metrics

    # The ranks' own clocks: every rank of every run started before any ended, the gate between.
    starts, ends = [start for start, _ in spans], [end for _, end in spans]
    assert len(spans) == len(TARGETS) * len(RANKS)
    assert max(starts) < released < min(ends), (spans, released)
    print(f"all six ranks trained together for {min(ends) - max(starts):.2f} s")

    # Each run's processes end with the run.
    deadline = time.monotonic() + 30
    while (left := {name: alive(tree) for name, tree in trees.items() if alive(tree)}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not left, f"processes of the runs still there 30 s after the runs ended: {left}"

    # The metadata is PostgreSQL's: the runs, as the scheduler recorded them.
    with contextlib.closing(deployment_postgres.connect()) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT run_id, state FROM dag_run WHERE dag_id = %s", (DAG_ID,))
        recorded = dict(cursor.fetchall())
    assert {run_id: recorded.get(run_id) for run_id in runs.values()} == dict.fromkeys(
        runs.values(), "success"
    )
    # Never in a SQLite file beside it.
    assert not (deployment.home / "airflow.db").exists()
