"""The DAGs of docs/first-dag.md and the README's first example, run from the documents' own text.

Each ``<!-- first-dag: NAME -->`` marker in the page is followed by a python block: the test writes
it to ``NAME`` in a fresh dags folder, as a reader would copy it, adds the README's first python
block (the ``@task.torch_distributor`` example), and runs the three DAGs with ``dag.test()`` in one
Airflow process (:func:`~tests.integration.run_dags.run_in_fresh_airflow`). This is also the
decorator's end-to-end test: the sweep's trials get an upstream task's value as an argument and are
mapped with ``.partial().expand()``; the script DAG shows ``kwargs`` as flags, ``set_output()``
and the ``checkpoint_dir`` XCom reaching a downstream task.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from airflow_provider_torchdist.outputs.run_paths import path_component
from tests.integration.run_dags import run_in_fresh_airflow
from tests.integration.test_dags import xcom

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "first-dag.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- first-dag: (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```", re.S)


def page_files() -> dict[str, str]:
    """The page's marked python blocks by file name."""
    files = {m["name"]: m["code"] for m in BLOCK.finditer(PAGE.read_text())}
    assert set(files) == {"first_training_script.py", "first_training.py", "first_sweep.py"}, files
    return files


def readme_example() -> str:
    """The README's first python block."""
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert match and "@task.torch_distributor" in match[1], "the README's first example uses the decorator"
    return match[1]


def test_the_first_dag_pages_dags_and_the_readme_example_run_as_written(tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    for name, code in {**page_files(), "readme_example.py": readme_example()}.items():
        (dags / name).write_text(code)
    home = tmp_path / "airflow"
    home.mkdir()
    states, output = run_in_fresh_airflow(home, dags, ["first_training", "first_sweep", "retrain"])
    db = home / "airflow.db"
    for dag_id in ("first_training", "first_sweep", "retrain"):
        assert states[dag_id]["state"] == "success", output[-8000:]

    # The script: its flags arrived (--epochs 3), rank 0's set_output() value reached the downstream
    # task, and so did the run's checkpoint directory (one checkpoint per epoch in it).
    run_id = states["first_training"]["run_id"]
    evaluated = xcom(db, "first_training", run_id, "evaluate")
    assert evaluated["epochs"] == 3 and evaluated["loss"] < 1.0, evaluated
    assert evaluated["checkpoints"], evaluated
    checkpoints = xcom(db, "first_training", run_id, "train", "checkpoint_dir")
    encoded_run = path_component(run_id, "run_id")
    assert checkpoints == str(home / "torchdist-checkpoints" / "first_training" / encoded_run / "train")

    # The sweep: one trial per rate, each with the upstream value, named by map_index_template.
    run_id = states["first_sweep"]["run_id"]
    best = xcom(db, "first_sweep", run_id, "pick_best")
    assert best["lr"] == 0.1 and best["loss"] < 1.0, best
    with sqlite3.connect(db) as conn:
        names = conn.execute(
            "SELECT rendered_map_index FROM task_instance WHERE dag_id='first_sweep' AND task_id='trial' "
            "ORDER BY map_index"
        ).fetchall()
    assert names == [("lr=0.01",), ("lr=0.1",)], "map_index_template names the trials by their lr"
