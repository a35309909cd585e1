"""Run DAGs with ``dag.test()`` in one process (Airflow's start-up is paid once) and print states.

Usage: ``python run_dags.py DAGS_FOLDER DAG_ID...``; needs a migrated AIRFLOW_HOME in the environment.
"""

from __future__ import annotations

import json
import sys

from airflow.dag_processing.dagbag import DagBag


def main(folder: str, dag_ids: list[str]) -> None:
    bag = DagBag(dag_folder=folder)
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    states = {}
    for dag_id in dag_ids:
        run = bag.get_dag(dag_id).test()
        states[dag_id] = {"state": str(run.state), "run_id": run.run_id}
    print("DAG_STATES " + json.dumps(states), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
