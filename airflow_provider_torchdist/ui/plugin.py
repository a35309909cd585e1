"""The ``torchdist`` plugin, registered through the provider's ``plugins`` entry: the "Training"
tab on every task instance's page, and the app behind it.

Every Airflow component loads provider plugins (the scheduler, the DAG processor, each task
process), and only the API server serves apps: this module imports Airflow's plugin base class
alone, and the FastAPI app (:mod:`.app`, which imports the API server's security) is built on the
first request it gets.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

from airflow.providers.common.compat.sdk import AirflowPlugin

#: Where the API server mounts the app (under ``[api] base_url``'s path).
URL_PREFIX = "/torchdist"
#: The tab's route on the task instance page: ``/dags/<dag>/runs/<run>/tasks/<task>/plugin/torchdist-training``.
URL_ROUTE = "torchdist-training"


def mount_path(base_url: str) -> str:
    """Where the app is on the API server's own origin: ``[api] base_url``'s path, then ``/torchdist``."""
    return urlsplit(base_url).path.rstrip("/") + URL_PREFIX


def training_view_href(base_url: str) -> str:
    """The iframe's address as the UI fills it in (``{DAG_ID}``, ``{RUN_ID}`` and ``{TASK_ID}``
    percent-encoded; ``{MAP_INDEX}`` only on a mapped task's page): on the API server's own origin,
    so the page shares the UI's cookie and storage."""
    return f"{mount_path(base_url)}/training/{{DAG_ID}}/{{RUN_ID}}/{{TASK_ID}}/{{MAP_INDEX}}"


def _base_url() -> str:
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="") or ""


class TrainingApp:
    """An ASGI app that builds :func:`~airflow_provider_torchdist.ui.app.create_app` on its first
    request (lifespan events included) and hands every request to it."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    @property
    def app(self) -> Any:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    from airflow_provider_torchdist.ui.app import create_app

                    self._app = create_app()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def has_external_views() -> bool:
    """Whether this Airflow gets the view. Plugins' ``external_views`` arrived in 3.1, but the view
    also uses the API server's security dependencies and XCom model as 3.3 has them, and CI tests
    it on 3.3 only (and 3.0, where it is off): before 3.3 the plugin registers nothing, and the
    metrics are in XCom as always."""
    import airflow
    from packaging.version import Version

    return Version(airflow.__version__).release >= (3, 3)


class TorchdistPlugin(AirflowPlugin):
    """The Training view: ``/torchdist`` on the API server, and a tab on task instance pages."""

    name = "torchdist"
    fastapi_apps = [{"app": TrainingApp(), "url_prefix": URL_PREFIX, "name": "torchdist"}]
    external_views = [
        {
            "name": "Training",
            "href": training_view_href(_base_url()),
            "destination": "task_instance",
            "url_route": URL_ROUTE,
            "icon": mount_path(_base_url()) + "/static/training-icon.svg",
        }
    ]
    if not has_external_views():
        fastapi_apps, external_views = [], []
