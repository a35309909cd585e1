"""Run DAGs with ``dag.test()`` in one process (Airflow's start-up is paid once) and print states.

Usage::

    python run_dags.py DAGS_FOLDER [DAG_ID...] [--run KEY DAG_ID CONF_JSON]...

Needs a migrated AIRFLOW_HOME in the environment (tests call :func:`run_in_fresh_airflow`, which
makes one and runs this script). Each positional DAG_ID runs once with no conf,
under the key DAG_ID; each ``--run`` runs DAG_ID with ``run_conf=CONF_JSON`` under the key KEY (so
one DAG can run with several confs). The last line printed is ``DAG_STATES {KEY: {...}}`` with
``{"dag_id": ..., "state": ..., "run_id": ...}`` per run, or ``"state": "refused"`` and ``"error"`` when Airflow
refused the conf (a Param validation error: no run was created, no task started).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.dag_processing.dagbag import DagBag

STATES_PREFIX = "DAG_STATES "


#: The time one DAG run may take here, on a loaded 2-core machine (measured up to 95 s under a CPU
#: hog); the runs go one after another, so the process's whole budget is this per run.
SECONDS_PER_RUN = 180


def run_in_fresh_airflow(
    home: Path, dags: Path, args: list[str], env: dict[str, str] | None = None, timeout: float | None = None
) -> tuple[dict[str, Any], str]:
    """For a test: migrate a fresh SQLite DB in ``home``, then run this script on ``dags`` with
    ``args`` (DAG ids, ``--run`` triples) in one Airflow process; returns the states and the output.
    ``env`` is added to this process's environment (``[openlineage]`` settings, data folders, ...).
    ``timeout``: the whole process's, by default :data:`SECONDS_PER_RUN` for each run (a fixed 600 s
    for 13 runs timed out under load)."""
    if timeout is None:
        # A run each: a positional DAG id is one word, a ``--run KEY DAG_ID CONF`` four.
        timeout = SECONDS_PER_RUN * (len(args) - 3 * args.count("--run"))
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        **(env or {}),
    }
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True
    )
    proc = subprocess.run(
        [sys.executable, __file__, str(dags), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(STATES_PREFIX)), None)
    assert line, f"run_dags.py printed no states (exit {proc.returncode}):\n{output[-5000:]}"
    return json.loads(line.removeprefix(STATES_PREFIX)), output


def run_one(bag: DagBag, dag_id: str, conf: dict[str, Any] | None) -> dict[str, Any]:
    """Run one DAG to its end; a conf that fails Param validation is reported, not raised."""
    from airflow.exceptions import ParamValidationError

    dag = bag.get_dag(dag_id)
    if dag is None:
        raise SystemExit(f"no DAG {dag_id!r} in the folder; found {sorted(bag.dag_ids)}")
    try:
        run = dag.test(run_conf=conf)
    except ParamValidationError as exc:
        return {"dag_id": dag_id, "state": "refused", "error": str(exc)}
    return {"dag_id": dag_id, "state": str(run.state), "run_id": run.run_id}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the DAGs folder")
    parser.add_argument("dag_ids", nargs="*", metavar="DAG_ID", help="run with no conf")
    parser.add_argument(
        "--run",
        nargs=3,
        action="append",
        default=[],
        metavar=("KEY", "DAG_ID", "CONF_JSON"),
        help="run DAG_ID with this conf, reported under KEY",
    )
    args = parser.parse_args(argv)
    runs: list[tuple[str, str, dict[str, Any] | None]] = [(d, d, None) for d in args.dag_ids]
    runs += [(key, dag_id, json.loads(conf)) for key, dag_id, conf in args.run]
    if len({key for key, _, _ in runs}) != len(runs):
        raise SystemExit("run keys must be unique")

    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=args.folder)
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    states = {key: run_one(bag, dag_id, conf) for key, dag_id, conf in runs}
    print(STATES_PREFIX + json.dumps(states), flush=True)


if __name__ == "__main__":
    main()
