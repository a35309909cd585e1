"""Checkpoints in object storage, through Airflow: two DAG runs of one retraining DAG with a fixed
``s3://`` checkpoint_dir on moto's S3 server (a separate process; the ranks and the downstream task
reach it over HTTP with s3fs, credentials from the Airflow connection ``ckpt_store``).

The first run keeps the newest and the 3 best checkpoints by val_loss, lists them best first in its
``checkpoints`` XCom, and its downstream task loads the best; the second run, with the same fixed
directory, trains from the start and says so (before issue 42 it resumed the first run's last step
and trained nothing). A third DAG run's asynchronous save fails to upload (its bucket is deleted
mid-run): the task fails, naming the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.run_dags import run_in_fresh_airflow
from tests.integration.test_dags import xcom
from tests.object_store import S3Server

pytestmark = pytest.mark.integration

DAG_FILE = Path(__file__).parent / "dags" / "checkpoint_store_dags.py"
DAG_ID = "checkpoint_store_retrain"


def test_two_dag_runs_on_a_fixed_s3_dir_keep_the_best_and_never_resume_each_other(
    s3_server: S3Server, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAG_FILE, dags / DAG_FILE.name)
    home = tmp_path / "airflow"
    home.mkdir()
    bucket, lost = s3_server.bucket(), s3_server.bucket()
    env = {
        "AIRFLOW_CONN_CKPT_STORE": s3_server.connection_uri_env(),
        "TORCHDIST_TEST_CKPT_BUCKET": bucket,
        "TORCHDIST_TEST_LOST_BUCKET": lost,
    }
    runs = ["--run", "first", DAG_ID, "{}", "--run", "second", DAG_ID, "{}"]
    states, output = run_in_fresh_airflow(
        home, dags, [*runs, "--run", "lost", "checkpoint_store_lost", "{}"], env=env
    )
    db = home / "airflow.db"
    assert states["first"]["state"] == "success" and states["second"]["state"] == "success", output[-8000:]
    first, second = states["first"]["run_id"], states["second"]["run_id"]
    assert first != second

    kept = xcom(db, DAG_ID, first, "train", "checkpoints")
    assert [(c["step"], c["metrics"]["val_loss"]) for c in kept] == [(4, 0.1), (2, 0.3), (3, 0.5), (6, 0.8)]
    assert all(
        c["uri"].startswith(f"s3://{bucket}/retrain/step-") and c["conn_id"] == "ckpt_store" for c in kept
    )
    assert xcom(db, DAG_ID, first, "evaluate") == {"best_w": 4.0}
    assert xcom(db, DAG_ID, first, "train") == {"start": 0}

    assert xcom(db, DAG_ID, second, "train") == {"start": 0}  # not 6: the first run's are not resumed
    assert "torchdist checkpoints: starting fresh (step 0)" in output
    assert f"from DAG run {first!r} of {DAG_ID}.train, which finished" in output
    # Each run's kept checkpoints are its own; none of the first run's was overwritten.
    assert [c["step"] for c in xcom(db, DAG_ID, second, "train", "checkpoints")] == [4, 2, 3, 6]
    assert xcom(db, DAG_ID, second, "evaluate") == {"best_w": 4.0}
    assert s3_server.filesystem().exists(kept[0]["uri"] + "/manifest.json")
    assert "test-secret-key" not in output  # the connection's secret never reaches a log

    # An asynchronous save whose upload fails (the bucket went away mid-run) fails the run,
    # naming the checkpoint, though the training function returned.
    assert states["lost"]["state"] == "failed", output[-8000:]
    assert (
        f"the asynchronous save of checkpoint step 2 (s3://{lost}/lost/step-000000002-" in output
        and "failed, so it was not committed" in output
    ), output[-8000:]
