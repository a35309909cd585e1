"""Run DAGs with ``dag.test()`` in one process (Airflow's start-up is paid once) and print states.

Usage::

    python run_dags.py DAGS_FOLDER [DAG_ID...] [--run KEY DAG_ID CONF_JSON]...

Needs a migrated AIRFLOW_HOME in the environment. Each positional DAG_ID runs once with no conf,
under the key DAG_ID; each ``--run`` runs DAG_ID with ``run_conf=CONF_JSON`` under the key KEY (so
one DAG can run with several confs). The last line printed is ``DAG_STATES {KEY: {...}}`` with
``{"dag_id": ..., "state": ..., "run_id": ...}`` per run, or ``"state": "refused"`` and ``"error"`` when Airflow
refused the conf (a Param validation error: no run was created, no task started).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from airflow.dag_processing.dagbag import DagBag
from airflow.exceptions import ParamValidationError


def run_one(bag: DagBag, dag_id: str, conf: dict[str, Any] | None) -> dict[str, Any]:
    """Run one DAG to its end; a conf that fails Param validation is reported, not raised."""
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

    bag = DagBag(dag_folder=args.folder)
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    states = {key: run_one(bag, dag_id, conf) for key, dag_id, conf in runs}
    print("DAG_STATES " + json.dumps(states), flush=True)


if __name__ == "__main__":
    main()
