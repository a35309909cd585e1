"""The example pipelines in dags/: they import cleanly, and each runs end to end on a real SQLite DB.

All runs share one migrated AIRFLOW_HOME and one ``run_dags.py`` process (Airflow starts once):

- ``retrain_pipeline`` (first run: the branch promotes, the model file appears),
- ``ui_triggered_training`` with a conf (``world_size`` follows ``num_processes``), and with an
  out-of-range conf (refused by Param validation before a run exists),
- ``script_training`` (a torchrun-style script; every rank's lines reach the task log).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
DAGS = HERE.parent.parent / "dags"
EXPECTED_DAG_IDS = {
    "example_torchdist",
    "retrain_pipeline",
    "ui_triggered_training",
    "script_training",
    "evaluate_model",
}
# Not the DAG's defaults (2 ranks, distributed, 0.1, 20 epochs), so the result shows the conf won.
PARAMS_CONF = {"num_processes": 3, "local_mode": True, "learning_rate": 0.05, "epochs": 5}
REFUSED_CONF = {"num_processes": 9}


@dataclass
class Runs:
    """What ``run_dags.py`` reported, and where to look afterwards."""

    states: dict[str, dict[str, Any]]
    db: Path
    models: Path
    output: str

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.db) as conn:
            return conn.execute(sql, args).fetchall()

    def xcom(self, key: str, task_id: str, xcom_key: str = "return_value") -> Any:
        """A run's XCom value (stored as JSON text)."""
        run = self.states[key]
        rows = self.query(
            "SELECT value FROM xcom WHERE dag_id=? AND run_id=? AND task_id=? AND key=?",
            run["dag_id"],
            run["run_id"],
            task_id,
            xcom_key,
        )
        assert rows, f"no XCom {xcom_key!r} for {key}.{task_id}"
        return json.loads(rows[0][0])

    def task_states(self, key: str) -> dict[str, str]:
        run = self.states[key]
        rows = self.query(
            "SELECT task_id, state FROM task_instance WHERE dag_id=? AND run_id=?",
            run["dag_id"],
            run["run_id"],
        )
        return dict(rows)


# -- parsing (no run) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_every_dag_file_imports(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert EXPECTED_DAG_IDS <= set(dagbag.dag_ids), sorted(dagbag.dag_ids)
    # The training script is not a DAG file: the parser must skip it, not run it.
    assert not any("train_script" in path for path in dagbag.file_last_changed)


def test_retrain_pipeline_shape(dagbag: Any) -> None:
    dag = dagbag.dags["retrain_pipeline"]
    assert dag.catchup is False
    assert dag.timetable.expression == "0 0 * * *"  # @daily
    assert dag.get_task("train").upstream_task_ids == {"prepare_data"}
    assert dag.get_task("choose").downstream_task_ids == {"promote", "skip_promotion"}


def test_evaluate_model_is_scheduled_on_the_model_retrain_pipeline_trains(dagbag: Any) -> None:
    [model] = dagbag.dags["retrain_pipeline"].get_task("train").outlets
    assert model.uri == "torchdist://models/retrain"
    assert dagbag.dags["evaluate_model"].timetable.asset_condition.objects == (model,)


@pytest.mark.parametrize(
    ("val_loss", "current_val_loss", "branch"),
    [
        (0.5, None, "promote"),
        (0.1, 0.2, "promote"),
        (0.2, 0.1, "skip_promotion"),
        (0.1, 0.1, "skip_promotion"),
    ],
)
def test_retrain_branch_promotes_only_a_better_model(
    dagbag: Any, val_loss: float, current_val_loss: float | None, branch: str
) -> None:
    choose = dagbag.dags["retrain_pipeline"].get_task("choose").python_callable
    assert choose({"val_loss": val_loss, "current_val_loss": current_val_loss}) == branch


def test_trigger_form_params(dagbag: Any) -> None:
    params = dagbag.dags["ui_triggered_training"].params
    schemas = {name: params.get_param(name).schema for name in params}
    assert schemas["num_processes"] == {"type": "integer", "minimum": 1, "maximum": 4, "title": "Processes"}
    assert schemas["local_mode"]["type"] == "boolean"
    assert schemas["learning_rate"]["exclusiveMinimum"] == 0 and schemas["learning_rate"]["maximum"] == 1
    assert (schemas["epochs"]["minimum"], schemas["epochs"]["maximum"]) == (1, 50)
    assert all(params.get_param(name).description for name in params)
    assert params["num_processes"] == 2


def test_script_dag_points_at_the_script(dagbag: Any) -> None:
    script = Path(dagbag.dags["script_training"].get_task("train").train_object)
    assert script.is_absolute() and script.is_file(), script


# -- running ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Migrate a fresh SQLite DB, then run every example pipeline once, in one Airflow process."""
    home = tmp_path_factory.mktemp("airflow_examples_home")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "TORCHDIST_DATA_DIR": str(home / "data"),
        "TORCHDIST_MODELS_DIR": str(home / "models"),
    }
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True
    )
    command = [
        sys.executable,
        str(HERE / "run_dags.py"),
        str(DAGS),
        "retrain_pipeline",
        "script_training",
        "fsdp_training",
        "--run",
        "params_refused",
        "ui_triggered_training",
        json.dumps(REFUSED_CONF),
        "--run",
        "params",
        "ui_triggered_training",
        json.dumps(PARAMS_CONF),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DAG_STATES ")), None)
    assert line, f"run_dags.py printed no states (exit {proc.returncode}):\n{output[-5000:]}"
    return Runs(json.loads(line.removeprefix("DAG_STATES ")), home / "airflow.db", home / "models", output)


def test_retrain_pipeline_promotes_on_its_first_run(runs: Runs) -> None:
    import torch

    assert runs.states["retrain_pipeline"]["state"] == "success", runs.output[-5000:]
    assert runs.task_states("retrain_pipeline") == {
        "prepare_data": "success",
        "train": "success",
        "evaluate": "success",
        "choose": "success",
        "promote": "success",
        "skip_promotion": "skipped",
    }
    evaluation = runs.xcom("retrain_pipeline", "evaluate")
    assert evaluation["current_val_loss"] is None  # no model before the first run
    assert evaluation["val_loss"] < 0.05, evaluation  # it learned y = x @ w + 0.5
    # report() history: the XCom key "metrics" agrees with rank 0's returned loss.
    metrics = runs.xcom("retrain_pipeline", "train", "metrics")
    assert [m["step"] for m in metrics] == [0, 10, 20, 30, 40, 50, 59]
    assert {m["rank"] for m in metrics} == {0}
    assert metrics[-1]["loss"] == evaluation["reported_loss"] == evaluation["train_loss"]
    assert metrics[0]["loss"] > 10 * metrics[-1]["loss"]
    # The promoted model is the candidate, and it is a usable state_dict.
    current = runs.models / "current.pt"
    assert current.read_bytes() == Path(evaluation["candidate"]).read_bytes()
    state_dict = torch.load(current)
    assert state_dict["weight"].shape == (1, 4)
    assert runs.xcom("retrain_pipeline", "promote") == str(current)
    # The trained model's asset event: its extra describes the run (what evaluate_model reads).
    [(uri, extra)] = runs.query(
        "SELECT a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE e.source_run_id=?",
        runs.states["retrain_pipeline"]["run_id"],
    )
    extra = json.loads(extra)
    assert uri == "torchdist://models/retrain"
    assert extra["metrics"] == {"loss": metrics[-1]["loss"]} and extra["step"] == 59
    assert (extra["output_type"], extra["output_format"], extra["world_size"]) == ("dict", "cloudpickle", 2)
    assert extra["output_size"] > 0 and extra["duration_s"] > 0 and "output_ref" not in extra


def test_params_dag_trains_with_the_conf(runs: Runs) -> None:
    assert runs.states["params"]["state"] == "success", runs.output[-5000:]
    result = runs.xcom("params", "train")  # JSON-native: the value itself, no envelope
    assert result["rank"] == 0
    assert result["world_size"] == PARAMS_CONF["num_processes"]
    assert result["epochs"] == PARAMS_CONF["epochs"]
    assert result["learning_rate"] == PARAMS_CONF["learning_rate"]
    assert 0 < result["loss"] < 0.02, result  # 5 epochs at 0.05 converge (0.0058 measured)
    metrics = runs.xcom("params", "train", "metrics")
    assert [m["step"] for m in metrics] == list(range(PARAMS_CONF["epochs"]))
    assert metrics[-1]["loss"] == result["loss"]


def test_out_of_range_conf_is_refused_before_running(runs: Runs) -> None:
    refused = runs.states["params_refused"]
    assert refused["state"] == "refused", refused
    assert "num_processes" in refused["error"] and "maximum of 4" in refused["error"]
    # Only the valid conf made a run; the refused one left no run and no task behind.
    confs = [row[0] for row in runs.query("SELECT conf FROM dag_run WHERE dag_id='ui_triggered_training'")]
    assert [json.loads(conf) for conf in confs] == [PARAMS_CONF], confs


def test_script_dag_runs_the_script_on_every_rank(runs: Runs) -> None:
    assert runs.states["script_training"]["state"] == "success", runs.output[-5000:]
    assert runs.task_states("script_training") == {"train": "success"}
    for rank in (0, 1):
        assert f"script rank {rank}/2 epoch 7 loss" in runs.output
        assert f"script rank {rank}/2 done: weight" in runs.output


def test_fsdp_dag_checkpoints_sharded_and_evaluates_the_best(runs: Runs) -> None:
    assert runs.states["fsdp_training"]["state"] == "success", runs.output[-5000:]
    assert runs.task_states("fsdp_training") == {"train": "success", "evaluate": "success"}
    assert runs.xcom("fsdp_training", "train") == {
        "world_size": 2,
        "resumed_from": 0,
        "loss": pytest.approx(runs.xcom("fsdp_training", "train", "metrics")[-1]["loss"]),
    }
    kept = runs.xcom("fsdp_training", "train", "checkpoints")
    assert [c["step"] for c in kept] == [40]  # the newest is the best: keep_last 1, keep_best 1
    manifest = json.loads(Path(kept[0]["uri"], "manifest.json").read_text())
    assert manifest["sharded"] and {"__0_0.distcp", "__1_0.distcp", "dcp.metadata"} == set(manifest["files"])
    evaluation = runs.xcom("fsdp_training", "evaluate")
    assert evaluation["step"] == 40 and evaluation["train_loss"] == kept[0]["metrics"]["loss"]
    assert evaluation["val_loss"] < 0.5, evaluation  # it learned to repeat tokens (2.8 untrained)
