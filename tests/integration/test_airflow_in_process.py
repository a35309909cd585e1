"""The operator with the Airflow features that run in a process of their own, with no deployment:
``dag.test()`` inside a user's own pytest, and every XCom in object storage. (The features that
need a scheduler and triggerer are in test_airflow_features.py, on the shared deployment.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_supervisor_left")]


# -- dag.test() in a user's own pytest ------------------------------------------------------------------

USER_PROJECT = Path(__file__).parent / "fixtures" / "user_project"


def test_dag_test_runs_a_mapped_sweep_inside_a_users_pytest(tmp_path: Path) -> None:
    """A user's project (tests/integration/fixtures/user_project): a DAG with a mapped sweep, and
    a test module calling ``dag.test()``, run by pytest in a process of its own."""
    import shutil
    import subprocess
    import sys

    project = tmp_path / "project"
    shutil.copytree(USER_PROJECT, project)
    (project / "check_lr_sweep.py").rename(project / "test_lr_sweep.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_lr_sweep.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-5000:], done.stderr[-3000:])
    assert "1 passed" in done.stdout, done.stdout[-3000:]


# -- XComs in object storage ------------------------------------------------------------------------


def test_with_every_xcom_in_object_storage_rank_zeros_value_reaches_the_next_task_and_verifies(
    tmp_path: Path,
) -> None:
    """``XComObjectStorageBackend`` with threshold 0 (every XCom a file in object storage): the
    signed envelope of rank 0's value, and a large output's reference, reach the downstream task
    through it and verify (``dag.test()`` on a fresh metadata DB)."""
    import json
    import sqlite3

    from tests.integration.run_dags import run_in_fresh_airflow

    store = tmp_path / "xcom-store"
    store.mkdir()
    env = {
        "AIRFLOW__CORE__XCOM_BACKEND": "airflow.providers.common.io.xcom.backend.XComObjectStorageBackend",
        "AIRFLOW__COMMON_IO__XCOM_OBJECTSTORAGE_PATH": f"file://{store}",
        "AIRFLOW__COMMON_IO__XCOM_OBJECTSTORAGE_THRESHOLD": "0",
    }
    dags = Path(__file__).parents[1] / "dags"
    dag_ids = ["torchdist_e2e_local", "torchdist_e2e_large_output"]
    states, output = run_in_fresh_airflow(tmp_path / "home", dags, dag_ids, env=env)
    assert all(states[d]["state"] == "success" for d in dag_ids), (states, output[-5000:])
    # Each XCom row holds a reference into the store, not the value.
    with sqlite3.connect(tmp_path / "home" / "airflow.db") as db:
        rows = db.execute("SELECT task_id, key, value FROM xcom WHERE key='return_value'").fetchall()
    assert {task_id for task_id, _, _ in rows} == {"train", "evaluate"}, rows
    for _, _, value in rows:
        reference = json.loads(value)
        assert isinstance(reference, str) and str(store) in reference, reference
    assert len([p for p in store.rglob("*") if p.is_file()]) >= 4
