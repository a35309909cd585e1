"""Runs when a model is trained: scheduled on the asset that ``retrain_pipeline``'s ``train`` updates.

``retrain_pipeline``'s :class:`TorchDistributorOperator` declares ``outlets=[MODEL]``. When it
succeeds, Airflow records an asset event for ``torchdist://models/retrain``, and the operator puts
a summary of the run in the event's ``extra``::

    {"metrics": {"loss": 0.0026}, "step": 59, "output_type": "dict", "output_format": "cloudpickle",
     "output_size": 1523, "world_size": 2, "duration_s": 38.2}

(plus ``output_ref`` when the model was too large for XCom and went to ``output_path``). That
event triggers a run of this DAG, whose ``read_metrics`` task takes the summary from
``triggering_asset_events``, logs it and returns it (XCom ``return_value``): no XCom of the
training DAG is read. To load the model itself, pull the ``return_value`` of the event's
``source_dag_id``/``source_run_id``/``source_task_id`` and call ``load_output`` on it.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import Asset, dag, task

#: The trained model, as retrain_pipeline declares it (an asset is known by its URI: the same here).
MODEL = Asset("torchdist://models/retrain")


@dag(
    schedule=[MODEL],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist", "example"],
    doc_md=__doc__,
)
def evaluate_model():
    @task
    def read_metrics(triggering_asset_events: Any = None) -> dict[str, Any]:
        """The newest model event's summary, with where it comes from."""
        from airflow.exceptions import AirflowSkipException

        events = list(triggering_asset_events[MODEL]) if triggering_asset_events else []
        if not events:
            raise AirflowSkipException(f"no event of {MODEL.uri}: this DAG runs when retrain_pipeline trains")
        event = events[-1]  # several trainings may end before this run starts: the newest counts
        summary = {
            "source": {
                "dag_id": event.source_dag_id,
                "run_id": event.source_run_id,
                "task_id": event.source_task_id,
            },
            "events": len(events),
            **event.extra,
        }
        print(f"MODEL EVENT {summary}")
        return summary

    read_metrics()


evaluate_model()
