"""One DAG run through the operator: ``python dag_run.py DAG_ID`` runs ``dag.test()`` on it.

Needs a migrated AIRFLOW_HOME and AIRFLOW__CORE__DAGS_FOLDER=bench/dags in the environment.
Prints one ``RESULT`` line with the run's state and the time spent inside ``dag.test()``.
"""

from __future__ import annotations

import json
import sys
import time

T_PROCESS = time.time()

from airflow.dag_processing.dagbag import DagBag  # noqa: E402
from airflow.settings import DAGS_FOLDER  # noqa: E402


def main(dag_id: str) -> int:
    t_parse = time.time()
    bag = DagBag(dag_folder=DAGS_FOLDER)
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    dag = bag.get_dag(dag_id)
    t_run = time.time()
    run = dag.test()
    t_done = time.time()
    state = str(run.state)
    print(
        "RESULT "
        + json.dumps(
            {
                "state": state,
                "import_s": t_parse - T_PROCESS,
                "parse_s": t_run - t_parse,
                "run_s": t_done - t_run,
            }
        ),
        flush=True,
    )
    return 0 if state.endswith("success") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
