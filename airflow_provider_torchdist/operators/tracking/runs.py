"""Find, continue or create a task instance's MLflow run (and a mapped task's parent run).

A run is found by its :data:`~airflow_provider_torchdist.operators.tracking.identity.KEY_TAG`: a retry or a
durable reattach continues the run an earlier try created (its id is in the tag, not in Airflow's
database, so this works without ``task_state_store`` too); a cleared task has a new key. Mapped
instances start concurrently and may each create the parent: every one then takes the oldest
parent with the sweep's key, and deletes its own if that is not it.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from airflow_provider_torchdist.operators.tracking.identity import KEY_TAG, PARENT_KEY_TAG, TaskIdentity

#: MLflow's tag of a nested run's parent, and of a run's display name.
PARENT_RUN_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created when missing (by whichever task gets there first)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:  # another task created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _runs_tagged(client: Any, experiment: str, tag: str, value: str) -> list[Any]:
    runs = client.search_runs(
        [experiment], filter_string=f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time ASC"]
    )
    return list(runs)


def sweep_parent(client: Any, experiment: str, identity: TaskIdentity) -> str:
    """The id of the mapped task's parent run: found, or created (one wins a race; see above)."""
    key = identity.sweep_key()
    found = _runs_tagged(client, experiment, PARENT_KEY_TAG, key)
    if found:
        return str(found[0].info.run_id)
    tags = {
        PARENT_KEY_TAG: key,
        "airflow.dag_id": identity.dag_id,
        "airflow.run_id": identity.run_id,
        "airflow.task_id": identity.task_id,
    }
    mine = client.create_run(experiment, tags=tags, run_name=f"{identity.task_id} (sweep)")
    oldest = _runs_tagged(client, experiment, PARENT_KEY_TAG, key)[0]
    if oldest.info.run_id != mine.info.run_id:
        client.delete_run(mine.info.run_id)
    return str(oldest.info.run_id)


def task_run(client: Any, experiment: str, identity: TaskIdentity) -> tuple[str, bool]:
    """The id of the task instance's run, and whether an earlier try created it (continued)."""
    found = _runs_tagged(client, experiment, KEY_TAG, identity.key())
    if found:
        run_id = str(found[0].info.run_id)
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, RUN_NAME_TAG, identity.run_name())
        return run_id, True
    tags = identity.tags()
    if identity.mapped:
        tags[PARENT_RUN_TAG] = sweep_parent(client, experiment, identity)
    run = client.create_run(experiment, tags=tags, run_name=identity.run_name())
    return str(run.info.run_id), False


def run_url(tracking_uri: str, experiment: str, run_id: str) -> str:
    """The run's page in the MLflow UI (an http(s) tracking URI's), else empty. Credentials in the
    URI (``https://user:token@host``) are left out: the URL goes to XCom and the extra link, which
    every reader of the DAG sees."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ""
    host = parts.netloc.rpartition("@")[2]
    base = urllib.parse.urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
    return f"{base}/#/experiments/{experiment}/runs/{run_id}"
