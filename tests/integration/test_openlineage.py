"""OpenLineage end to end: with the OpenLineage provider installed and ``[openlineage]
spark_inject_parent_job_info`` on, the running Spark application's SparkConf carries the task's
OpenLineage identity, the one Airflow's own OpenLineage events report for the task.

The Spark-side OpenLineage listener is a Maven jar, not here; what it would read is the SparkConf,
which the application's event log records (``SparkListenerEnvironmentUpdate``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.run_dags import run_in_fresh_airflow

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]
import airflow.providers.openlineage  # noqa: E402,F401  (in the [test] extra: missing fails, not skips)

DAGS = Path(__file__).parents[1] / "dags"
DAG_ID = "torchdist_e2e_openlineage"
NAMESPACE = "torchdist-it"


@pytest.fixture(scope="module")
def lineage_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    """One run of the DAG on a fresh SQLite DB, with Airflow's own OpenLineage events written to a
    file; returns the run's state, the Airflow home and the output."""
    home = tmp_path_factory.mktemp("airflow_openlineage_home")
    (home / "spark-events").mkdir()
    env = {
        "AIRFLOW__OPENLINEAGE__SPARK_INJECT_PARENT_JOB_INFO": "True",
        "AIRFLOW__OPENLINEAGE__NAMESPACE": NAMESPACE,
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(home / "openlineage.jsonl"), "append": True}
        ),
    }
    states, output = run_in_fresh_airflow(home, DAGS, [DAG_ID], env, timeout=300)
    return states[DAG_ID], home, output


def spark_properties_of_the_application(event_logs: Path) -> dict[str, str]:
    """The Spark properties the one application in ``event_logs`` ran with, from its event log."""
    logs = [p for p in event_logs.iterdir() if p.is_file()]
    assert len(logs) == 1, f"expected one application's event log, found {logs}"
    for line in logs[0].read_text().splitlines():
        event = json.loads(line)
        if event["Event"] == "SparkListenerEnvironmentUpdate":
            props = event["Spark Properties"]
            return dict(props) if isinstance(props, dict) else {k: v for k, v in props}
    raise AssertionError(f"no SparkListenerEnvironmentUpdate in {logs[0]}")


def airflow_task_start_event(events_file: Path) -> dict:
    """The OpenLineage START event Airflow emitted for the train task."""
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
    starts = [e for e in events if e["eventType"] == "START" and e["job"]["name"] == f"{DAG_ID}.train"]
    assert len(starts) == 1, f"expected one START event for the task, got {[e['job'] for e in events]}"
    return starts[0]


def test_the_running_applications_sparkconf_has_the_tasks_openlineage_identity(
    lineage_run: tuple[dict, Path, str],
) -> None:
    run, home, output = lineage_run
    assert run["state"] == "success", output[-5000:]
    props = spark_properties_of_the_application(home / "spark-events")
    lineage = {k: v for k, v in props.items() if k.startswith("spark.openlineage.")}
    task = airflow_task_start_event(home / "openlineage.jsonl")
    dag_run = task["run"]["facets"]["parent"]["run"]  # the task's parent: its DAG run
    assert lineage == {
        "spark.openlineage.parentJobNamespace": NAMESPACE,
        "spark.openlineage.parentJobName": f"{DAG_ID}.train",
        "spark.openlineage.parentRunId": task["run"]["runId"],
        "spark.openlineage.rootParentJobNamespace": NAMESPACE,
        "spark.openlineage.rootParentJobName": DAG_ID,
        "spark.openlineage.rootParentRunId": dag_run["runId"],
    }
    assert task["job"]["namespace"] == NAMESPACE
    # Only the parent job: the transport was not asked for (and a file transport is not sent anyway).
    assert not any(k.startswith("spark.openlineage.transport") for k in props)
