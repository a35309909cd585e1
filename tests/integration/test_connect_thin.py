"""A DAG over Spark Connect on a thin Airflow worker: only what the Spark provider pulls
(``pyspark-client``), no full pyspark, no Java, no torch.

``scripts/thin-worker-env`` builds ./.venv-thin (the package without its ``[spark]`` extra); then
``airflow dags test torchdist_e2e_connect`` (tests/integration/dags/torchdist_e2e_connect.py) runs
in it, in a fresh AIRFLOW_HOME, with PATH holding only the thin venv's ``bin`` (so no ``java``: this
machine has one in /usr/bin) and no JAVA_HOME or SPARK_HOME, over a ``spark_connect`` connection to
the session's Connect server (``local[2]``, the main venv: its executors have torch).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.integration.connect_server import ConnectServer
from tests.integration.test_dags import xcom

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THIN = ROOT / ".venv-thin"
DAG_FILE = Path(__file__).parent / "dags" / "torchdist_e2e_connect.py"
DAG_ID = "torchdist_e2e_connect"
CONN_ID = "torchdist_connect"


def thin_env(home: Path, dags: Path, connect_port: int) -> dict[str, str]:
    """The worker's whole environment: nothing of ours leaks in (no PATH, JAVA_HOME, SPARK_HOME,
    VIRTUAL_ENV or AIRFLOW_* of this process)."""
    env = {key: os.environ[key] for key in ("HOME", "LANG", "LC_ALL", "TMPDIR", "TZ") if key in os.environ}
    conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_port}
    env |= {
        "PATH": str(THIN / "bin"),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps(conn),
    }
    return env


def airflow(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    """``airflow ARGS`` with the thin venv's Python; fails the test (with the output) when it fails."""
    proc = subprocess.run(
        [str(THIN / "bin" / "python"), "-m", "airflow", *args],
        env=env,
        cwd=env["AIRFLOW_HOME"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"airflow {' '.join(args)} exited {proc.returncode}:\n{output[-10000:]}"
    return output


def test_a_dag_trains_over_connect_from_a_worker_without_pyspark_java_or_torch(
    connect_server: ConnectServer,
    tmp_path: Path,
) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "thin-worker-env")], cwd=ROOT, check=True)
    home = tmp_path / "airflow_home"
    home.mkdir()
    dags = tmp_path / "dags"  # only this DAG's file: the others need the full pyspark or torch
    dags.mkdir()
    (dags / DAG_FILE.name).symlink_to(DAG_FILE)
    env = thin_env(home, dags, connect_server.port)
    # java really is out of reach: on PATH for this process, not for the worker's.
    assert shutil.which("java", path=env["PATH"]) is None
    assert not {"JAVA_HOME", "SPARK_HOME"} & env.keys()

    airflow(env, "db", "migrate")
    doctor = subprocess.run(
        [str(THIN / "bin" / "python"), "-m", "airflow_provider_torchdist", "doctor", "--connect"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert doctor.returncode == 0 and "ready to train" in doctor.stdout, doctor.stdout + doctor.stderr
    airflow(env, "dags", "reserialize")  # Airflow 3.0 tests a DAG only once it is serialized
    output = airflow(env, "dags", "test", DAG_ID, timeout=480)

    assert "DagRun Finished" in output and "state=success" in output, output[-10000:]
    assert "distributed mode over Spark Connect: 2 Spark task(s)" in output, output[-10000:]
    db = home / "airflow.db"
    run_id = _run_id(db)
    # What the task saw, from inside: this worker's Python, no java, pyspark-client's pyspark/.
    (site_packages,) = THIN.glob("lib/python3.*/site-packages")
    assert xcom(db, DAG_ID, run_id, "environment") == {
        "python": str(THIN / "bin" / "python"),
        "java": None,
        "pyspark": str(site_packages / "pyspark"),
        "jars": False,
        "torch": False,
    }
    assert xcom(db, DAG_ID, run_id, "check") == {
        "rank": 0,
        "world_size": 2,
        "ranks": [1.0, 2.0],
        "type": "tuple",
    }
    pushed = xcom(db, DAG_ID, run_id, "train")  # a tuple is not JSON: the signed pickle envelope
    assert pushed["__torchdist_output__"] == 2 and pushed["format"] == "cloudpickle", pushed


def _run_id(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT run_id, state FROM dag_run WHERE dag_id=?", (DAG_ID,)).fetchall()
    assert len(rows) == 1 and rows[0][1] == "success", rows
    return rows[0][0]
