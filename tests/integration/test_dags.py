"""DAG-level tests on a real SQLite metadata DB: the operator, XCom and a downstream task."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from tests.integration.run_dags import run_in_fresh_airflow

# The first test's set-up runs all 14 DAG runs (one Airflow process): 390 s here quiet, 560 s under a
# CPU hog; the 900 s default is for one test's own runs.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent
DAGS = HERE.parent / "dags"
DAG_IDS = [
    "torchdist_e2e_local",
    "torchdist_e2e_distributed",
    "torchdist_e2e_failure",
    "torchdist_e2e_retry_resume",
    "torchdist_e2e_timeout",
    "torchdist_e2e_graceful_resume",
    "torchdist_e2e_large_output",
    "torchdist_e2e_bad_submit",
    "torchdist_e2e_module_local",
    "torchdist_e2e_module_distributed",
    "torchdist_e2e_log_ranks",
    "torchdist_e2e_log_ranks_failure",
    "torchdist_e2e_elastic",
    "torchdist_e2e_train_data",
]


@pytest.fixture(scope="module")
def dag_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    """Migrate a fresh SQLite DB, then run the test DAGs once, in one Airflow process."""
    home = tmp_path_factory.mktemp("airflow_dags_home")
    states, output = run_in_fresh_airflow(home, DAGS, DAG_IDS)
    return states, home / "airflow.db", output


def xcom(db: Path, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> object:
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            "SELECT value FROM xcom WHERE dag_id=? AND run_id=? AND task_id=? AND key=?",
            (dag_id, run_id, task_id, key),
        ).fetchone()
    assert row is not None, f"no XCom {key} for {dag_id}.{task_id}"
    value = json.loads(row[0])
    if isinstance(value, str) and value[:1] in "{[":  # some values are stored JSON-in-JSON
        value = json.loads(value)
    return value


@pytest.mark.parametrize("dag_id", ["torchdist_e2e_local", "torchdist_e2e_distributed"])
def test_downstream_task_reads_rank_zero_value(dag_runs: tuple[dict, Path, str], dag_id: str) -> None:
    states, db, output = dag_runs
    assert states[dag_id]["state"] == "success", output[-5000:]
    summary = xcom(db, dag_id, states[dag_id]["run_id"], "evaluate")
    assert summary == {"rank": 0, "world_size": 2, "tensor_type": "Tensor", "ranks": [2.0, 4.0]}
    # What the train task pushed is the documented envelope (a dict of tensors is not JSON).
    pushed = xcom(db, dag_id, states[dag_id]["run_id"], "train")
    assert pushed["__torchdist_output__"] == 2 and pushed["format"] == "cloudpickle"
    # Signed for the task try that produced it (the evaluate task checked it with expect=).
    assert pushed["origin"] == {
        "dag_id": dag_id,
        "run_id": states[dag_id]["run_id"],
        "task_id": "train",
        "map_index": -1,
        "try": 1,
    }
    if dag_id.endswith("distributed"):  # the Spark UI link's URL, pushed while the run went on
        assert str(xcom(db, dag_id, states[dag_id]["run_id"], "train", "spark_ui_url")).startswith(
            "http://127.0.0.1:"
        )


def test_failing_rank_fails_the_task_with_its_error(dag_runs: tuple[dict, Path, str]) -> None:
    states, db, output = dag_runs
    assert states["torchdist_e2e_failure"]["state"] == "failed"
    assert "rank 1 on 127.0.0.1 failed: RuntimeError: rank 1 was told to fail" in output
    with sqlite3.connect(db) as conn:
        rows = dict(
            conn.execute(
                "SELECT task_id, state FROM task_instance WHERE dag_id='torchdist_e2e_failure'"
            ).fetchall()
        )
    assert rows["train"] == "failed"
    assert rows["evaluate"] == "upstream_failed"


def test_spark_submits_own_error_reaches_the_task_log(dag_runs: tuple[dict, Path, str]) -> None:
    # The operator's run is supervised: spark-submit's output is the supervisor's, and must still
    # reach the task's log (not only a supervisor log that goes with the staging directory).
    states, _, output = dag_runs
    assert states["torchdist_e2e_bad_submit"]["state"] == "failed"
    assert "Invalid maximum heap size: -Xmxlots" in output, output[-5000:]


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_a_module_shipped_as_a_package_directory_runs_on_every_rank_with_its_args(
    dag_runs: tuple[dict, Path, str], mode: str
) -> None:
    states, db, output = dag_runs
    dag_id = f"torchdist_e2e_module_{mode}"
    assert states[dag_id]["state"] == "success", output[-5000:]
    out = db.parent / dag_id
    for rank in (0, 1):
        assert (out / f"rank-{rank}").read_text() == f"--out {out} --lr 0.5|2|__main__"


def test_log_ranks_hides_other_ranks_lines_but_never_a_failing_ranks(
    dag_runs: tuple[dict, Path, str],
) -> None:
    states, _, output = dag_runs
    assert states["torchdist_e2e_log_ranks"]["state"] == "success", output[-5000:]
    assert "chatty quiet rank 0" in output
    assert "chatty quiet rank 1" not in output  # kept in the run's ranks.log instead
    assert "log_ranks: only rank(s) 0 shown here" in output
    # Filtered, and failing: its last lines and its traceback still reach the log and the error.
    assert states["torchdist_e2e_log_ranks_failure"]["state"] == "failed"
    assert "chatty loud rank 1" in output
    assert "RuntimeError: rank 1 failed on purpose (loud)" in output


def _task_tries(db: Path, dag_id: str) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT task_id, state, try_number FROM task_instance WHERE dag_id=?", (dag_id,)
        ).fetchall()
    return {task: (state, tries) for task, state, tries in rows}


def test_airflow_retry_resumes_from_the_latest_checkpoint(dag_runs: tuple[dict, Path, str]) -> None:
    states, db, output = dag_runs
    dag_id = "torchdist_e2e_retry_resume"
    assert states[dag_id]["state"] == "success", output[-5000:]
    assert _task_tries(db, dag_id)["train"] == ("success", 2)  # try 1 lost rank 1, try 2 finished
    result = xcom(db, dag_id, states[dag_id]["run_id"], "train")
    assert result["resumed_from"] == 4  # newest checkpoint before the kill at step 5
    assert result["weight"] == 10.0  # the target step count, no step done twice
    assert f"/{dag_id}/" in result["checkpoint_dir"]  # the per-task directory, the same for both tries


def test_execution_timeout_kills_every_process(dag_runs: tuple[dict, Path, str]) -> None:
    states, db, output = dag_runs
    assert states["torchdist_e2e_timeout"]["state"] == "failed"
    assert _task_tries(db, "torchdist_e2e_timeout")["train"][0] == "failed"
    assert "Timeout" in output or "timed out" in output
    markers = db.parent / "sleepers"
    assert markers.is_dir(), "no rank started before the execution_timeout: the test proved nothing"
    sleepers = list(markers.iterdir())
    assert len(sleepers) == 2  # both ranks were running when the timeout hit
    for marker in sleepers:
        assert not Path(f"/proc/{marker.name}").exists(), f"rank process {marker.name} outlived the timeout"


def test_a_run_stopped_by_its_timeout_checkpoints_in_its_grace_period_and_the_retry_resumes(
    dag_runs: tuple[dict, Path, str],
) -> None:
    """Try 1 trains until its execution_timeout; the ranks get the stop, checkpoint after the same
    step and return within the grace period; the retry (no delay) waits for the stopped run, then
    resumes from that checkpoint. The ranks' own step logs show every step trained, none twice."""
    states, db, output = dag_runs
    dag_id = "torchdist_e2e_graceful_resume"
    assert states[dag_id]["state"] == "success", output[-5000:]
    assert _task_tries(db, dag_id)["train"] == ("success", 2)
    result = xcom(db, dag_id, states[dag_id]["run_id"], "train")
    stopped_at = result["resumed_from"]
    assert stopped_at > 0, "try 1 trained no step before its timeout: the test proved nothing"
    assert result["weight"] == 2000.0
    # The stop as the task log tells it, to its end (Airflow's own execution_timeout, at the same
    # moment, does not cut the log short: the hook follows the stop through).
    assert "stop requested (timeout): ranks have 20 s to checkpoint" in output
    assert "the stop request (timeout) goes to 2 rank(s)" in output
    assert re.search(r"the run ended [0-9.]+ s after the stop request", output), output[-5000:]
    checkpoints = next((db.parent / "torchdist-checkpoints" / dag_id).rglob("steps-0.log")).parent
    for rank in (0, 1):
        trained = [int(x) for x in (checkpoints / f"steps-{rank}.log").read_text().split()]
        assert sorted(set(trained)) == list(range(2000)), f"rank {rank} skipped steps"
        # The step under way when the stop came finished and was checkpointed: nothing trained twice
        # (the issue allows the interrupted one).
        assert len(trained) - len(set(trained)) <= 1, f"rank {rank} trained steps twice"
        assert trained.index(stopped_at) == stopped_at  # try 2 began where try 1's checkpoint ended


def test_large_output_travels_by_reference(dag_runs: tuple[dict, Path, str]) -> None:
    states, db, output = dag_runs
    dag_id = "torchdist_e2e_large_output"
    assert states[dag_id]["state"] == "success", output[-5000:]
    pushed = xcom(db, dag_id, states[dag_id]["run_id"], "train")
    assert "data" not in pushed and pushed["ref"].startswith("file://") and pushed["size"] > 8_000_000
    assert Path(pushed["ref"].removeprefix("file://")).stat().st_size == pushed["size"]
    summary = xcom(db, dag_id, states[dag_id]["run_id"], "evaluate")
    assert summary == {"rank": 0, "numel": 2_000_000, "sum": 2_000_000.0}


def test_an_elastic_range_trains_and_its_world_sizes_reach_xcom(dag_runs: tuple[dict, Path, str]) -> None:
    states, db, output = dag_runs
    dag_id = "torchdist_e2e_elastic"
    assert states[dag_id]["state"] == "success", output[-5000:]
    run_id = states[dag_id]["run_id"]
    assert xcom(db, dag_id, run_id, "sizes") == [[2, "start"]]  # the templated "1:2" took both nodes
    assert "elastic: training starts with world size 2" in output


def test_a_parquet_query_is_dealt_to_the_ranks_in_both_modes(dag_runs: tuple[dict, Path, str]) -> None:
    """Every row of the query reaches exactly one rank, the shards are equal, in local mode (2 ranks
    on the driver) and across 2 Spark tasks of 2 ranks each (nproc_per_node=2)."""
    states, db, output = dag_runs
    dag_id = "torchdist_e2e_train_data"
    assert states[dag_id]["state"] == "success", output[-5000:]
    # 1050 ids, those divisible by 7 filtered out: 900 rows; 2 ranks: 450 each; 4 ranks: 225 each.
    assert xcom(db, dag_id, states[dag_id]["run_id"], "check") == {
        "local": {"sizes": [450, 450], "no_duplicates": True, "dropped_at_most_world_minus_1": True},
        "distributed": {"sizes": [225] * 4, "no_duplicates": True, "dropped_at_most_world_minus_1": True},
    }
