"""The Training view's FastAPI app, mounted by Airflow's API server at ``/torchdist``.

- ``GET /api/runs/{dag_id}/{run_id}/{task_id}?map_index=-1``: the figures of one task instance
  (:func:`~airflow_provider_torchdist.ui.figures.training_figures`). Authenticated and authorized
  exactly as Airflow's own REST API: its ``requires_access_dag`` dependencies take the user from
  the API server's token (``Authorization: Bearer``) or the UI's cookie (401 without either) and
  ask the auth manager whether the user may read this DAG's task instances and XComs (403 if not).
- ``GET /training/{dag_id}/{run_id}/{task_id}/{map_index}``: the page the UI shows in its iframe,
  with ``/static/`` (its script and style). They hold no data: the page fetches the endpoint above
  with the user's own cookie.

Tests replace :func:`task_facts_reader` and :func:`live_history_reader` through FastAPI's
``app.dependency_overrides``.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated, Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from airflow_provider_torchdist.supervision.record import TaskBinding
from airflow_provider_torchdist.ui.figures import checkpoint_marks, training_figures
from airflow_provider_torchdist.ui.task_facts import (
    AirflowTaskFacts,
    LiveHistory,
    TaskFacts,
    TaskFactsReader,
    is_training_task,
    live_history,
    metric_history,
)

STATIC_DIR = Path(__file__).parent / "static"
#: Where the page's HTML says the app is mounted; replaced by the mount's path when served.
ROOT_PLACEHOLDER = "__TORCHDIST_ROOT__"

#: Reading a task's figures is reading its task instance and its XCom, as the REST API checks them.
READ_ACCESS = [
    Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE)),
    Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM)),
]


def task_facts_reader(session: SessionDep) -> TaskFactsReader:
    return AirflowTaskFacts(session)


def live_history_reader() -> LiveHistory:
    return live_history


def _page(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    text = (STATIC_DIR / "training.html").read_text().replace(ROOT_PLACEHOLDER, html.escape(root))
    return HTMLResponse(text, headers={"Cache-Control": "no-cache"})


def not_a_training_task(task_id: str, facts: TaskFacts) -> dict[str, Any]:
    """The answer for a task the Training tab has nothing to show of."""
    operator = facts.custom_operator_name or facts.operator
    return {
        "training_task": False,
        "state": facts.state,
        "operator": operator,
        "message": f"{task_id!r} is not a training task (its operator is {operator}): the Training tab shows "
        "the metrics of TorchDistributorOperator and @task.torch_distributor tasks only.",
    }


def create_app() -> FastAPI:
    """The app the ``torchdist`` plugin mounts (see the module docstring)."""
    app = FastAPI(title="torchdist", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/api/runs/{dag_id}/{run_id}/{task_id}", dependencies=READ_ACCESS)
    def run_figures(
        dag_id: str,
        run_id: str,
        task_id: str,
        facts_reader: Annotated[TaskFactsReader, Depends(task_facts_reader)],
        live: Annotated[LiveHistory, Depends(live_history_reader)],
        map_index: Annotated[int, Query(ge=-1)] = -1,
    ) -> dict[str, Any]:
        """The figures of one task instance: state, metric history, progress and world size, with
        ``training_task: true``; for a task that is not a training task, ``training_task: false``
        and a message saying so (Airflow shows the tab on every task)."""
        # A plain function: FastAPI runs it in its thread pool, so the lifeline's blocking socket
        # (LIVE_TIMEOUT_S at most) never holds up the API server's event loop.
        facts = facts_reader.read(dag_id, run_id, task_id, map_index)
        if facts is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                f"No task instance {task_id!r} (map index {map_index}) in run {run_id!r} of DAG {dag_id!r}",
            )
        if not is_training_task(facts):
            return not_a_training_task(task_id, facts)
        source, history = metric_history(facts, live, TaskBinding(dag_id, run_id, task_id, map_index))
        figures = training_figures(facts.state, history, facts.world_size, source, facts.rank_step_times)
        tracked = {"mlflow_run_url": facts.mlflow_run_url} if facts.mlflow_run_url else {}
        kept = {"checkpoints": marks} if (marks := checkpoint_marks(facts.checkpoints)) else {}
        return {"training_task": True, **figures, **tracked, **kept}

    # The UI fills {MAP_INDEX} in only on a mapped task's page: elsewhere it arrives as is.
    app.add_api_route("/training/{dag_id}/{run_id}/{task_id}/{map_index}", _page, methods=["GET"])
    app.add_api_route("/training/{dag_id}/{run_id}/{task_id}", _page, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
