"""The framework callbacks end to end: a stock Hugging Face / Lightning Trainer trains with two
ranks in two Spark tasks, and its loss reaches the task log and XCom ``metrics`` through the
callback alone (tests/integration/dags/callbacks_training.py, run with ``dag.test()``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.run_dags import run_in_fresh_airflow
from tests.integration.test_dags import xcom

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

DAGS = Path(__file__).parent / "dags"
DAG_IDS = ["callbacks_transformers", "callbacks_lightning"]


@pytest.fixture(scope="module")
def dag_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    """Both DAGs once, in one Airflow process, from a folder holding only their file (another
    file's import error must not stop them)."""
    home = tmp_path_factory.mktemp("airflow_callbacks_home")
    folder = tmp_path_factory.mktemp("callbacks_dags") / "dags"
    folder.mkdir()
    (folder / "callbacks_training.py").symlink_to(DAGS / "callbacks_training.py")
    states, output = run_in_fresh_airflow(home, folder, DAG_IDS)
    return states, home / "airflow.db", output


def _run(dag_runs: tuple[dict[str, Any], Path, str], dag_id: str) -> tuple[list[dict], dict, dict, str]:
    states, db, output = dag_runs
    assert states[dag_id]["state"] == "success", output[-8000:]
    run_id = states[dag_id]["run_id"]
    return (
        xcom(db, dag_id, run_id, "train", "metrics"),
        xcom(db, dag_id, run_id, "train"),
        xcom(db, dag_id, run_id, "check"),
        output,
    )


def test_a_transformers_trainer_reports_through_the_callback(dag_runs) -> None:
    import accelerate  # noqa: F401  (the Hugging Face Trainer's own requirement; in the [test] extra)
    import transformers  # noqa: F401

    metrics, trained, checked, output = _run(dag_runs, "callbacks_transformers")
    # The Trainer saw torchrun's world: two processes, one per Spark task, rank 0 answering.
    assert trained == {"world_size": 2, "rank": 0, "global_step": 16, "max_steps": 16}
    losses = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in losses] == list(range(2, 17, 2))  # logging_steps=2
    for m in losses:
        assert m["rank"] == 0 and m["total_steps"] == 16
        assert {"loss", "learning_rate", "epoch"} <= m.keys() and m["loss"] > 0
    assert losses[-1]["epoch"] == 2.0
    assert {m["rank"] for m in metrics} == {0}  # rank 1's Trainer logs too; only rank 0 reports
    assert metrics[-1]["step"] == 16 and "train_loss" in metrics[-1]  # the closing summary
    assert checked["steps"] == list(range(2, 17, 2)) and checked["total_steps"] == [16]
    assert re.search(r"\[metrics\] rank 0 step 2/16: loss=\S+ grad_norm=\S+ learning_rate=\S+ epoch=", output)
    _kept_by_the_checkpoint_callback(dag_runs, "callbacks_transformers", [16, 8], "model.safetensors")


def test_a_lightning_trainer_reports_through_the_callback(dag_runs) -> None:
    metrics, trained, checked, output = _run(dag_runs, "callbacks_lightning")
    assert trained == {"world_size": 2, "rank": 0, "global_step": 24, "max_steps": 24}
    assert [m["step"] for m in metrics] == list(range(2, 25, 2))  # log_every_n_steps=2
    for m in metrics:
        assert m["rank"] == 0 and m["total_steps"] == 24
        assert {"loss", "learning_rate", "epoch", "train_loss"} <= m.keys()
        assert m["learning_rate"] == 0.05
    assert [m["epoch"] for m in metrics] == [0] * 4 + [1] * 4 + [2] * 4
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learned
    assert checked["names"] == ["epoch", "learning_rate", "loss", "train_loss"]
    assert "[metrics] rank 0 step 2/24: loss=" in output
    _kept_by_the_checkpoint_callback(dag_runs, "callbacks_lightning", [24, 16], "state.pt")


def _kept_by_the_checkpoint_callback(
    dag_runs: tuple[dict[str, Any], Path, str], dag_id: str, steps: list[int], a_file: str
) -> None:
    """The framework's checkpoints reached the task's store (two ranks, DDP), newest 2 kept,
    listed in XCom ``checkpoints`` with the logged metrics, and their files there."""
    states, db, _ = dag_runs
    kept = xcom(db, dag_id, states[dag_id]["run_id"], "train", "checkpoints")
    assert [entry["step"] for entry in kept] == steps
    assert all("loss" in entry["metrics"] or "train_loss" in entry["metrics"] for entry in kept)
    manifest = json.loads((Path(kept[0]["uri"]) / "manifest.json").read_text())
    assert a_file in manifest["files"] and manifest["finished"] is True
