"""Extra links on a training task: the run's Spark UI, its page on a standalone master, its
page on the Spark history server, and its MLflow run (with ``mlflow_conn_id``).

The operator pushes the URLs to XCom as soon as the driver reports them, so the buttons work
while the task runs (extra links are otherwise only computed at task end). The Spark UI is the
driver's own web server: it is gone once the run ends. The master's page and the history server's
stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from airflow.providers.common.compat.sdk import BaseOperatorLink, XCom

SPARK_UI_XCOM_KEY = "spark_ui_url"
SPARK_MASTER_APP_XCOM_KEY = "spark_master_app_url"
SPARK_HISTORY_XCOM_KEY = "spark_history_url"
#: The task instance's MLflow run page (``mlflow_conn_id``), pushed at task start.
MLFLOW_RUN_XCOM_KEY = "mlflow_run_url"
#: Every link's key; an empty URL under one means "no such page" (the link shows nothing).
LINK_XCOM_KEYS = (SPARK_UI_XCOM_KEY, SPARK_MASTER_APP_XCOM_KEY, SPARK_HISTORY_XCOM_KEY, MLFLOW_RUN_XCOM_KEY)


@dataclass(frozen=True)
class ApplicationLinks:
    """Where a run's Spark application can be looked at, known once the driver reports its id.

    Example::

        ApplicationLinks.of("app-20261123-0001", "http://10.0.0.5:4040",
                            master_web_ui="http://spark-master:8080",
                            history_server="http://spark-history:18080")
    """

    app_id: str
    #: The driver's web UI: live while the application runs, gone when it ends.
    spark_ui: str | None = None
    #: The application's page on a standalone master's web UI (connection extra ``master-web-ui``).
    master_page: str | None = None
    #: The application's page on the Spark history server (connection extra ``history-server-url``),
    #: there once the history server has read the application's event log.
    history_page: str | None = None

    @classmethod
    def of(
        cls,
        app_id: str,
        spark_ui: str | None,
        *,
        master_web_ui: str | None = None,
        history_server: str | None = None,
    ) -> ApplicationLinks:
        app = quote(app_id, safe="")
        return cls(
            app_id=app_id,
            spark_ui=spark_ui or None,
            master_page=f"{master_web_ui.rstrip('/')}/app/?appId={app}" if master_web_ui else None,
            history_page=f"{history_server.rstrip('/')}/history/{app}/" if history_server else None,
        )

    def xcom_values(self) -> dict[str, str]:
        """The XCom key and URL of each link that has one."""
        urls = {
            SPARK_UI_XCOM_KEY: self.spark_ui,
            SPARK_MASTER_APP_XCOM_KEY: self.master_page,
            SPARK_HISTORY_XCOM_KEY: self.history_page,
        }
        return {key: url for key, url in urls.items() if url}


class SparkUILink(BaseOperatorLink):
    """The Spark driver's web UI of the run: it answers only while the application runs."""

    name = "Spark UI"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=SPARK_UI_XCOM_KEY) or ""


class SparkMasterAppLink(BaseOperatorLink):
    """The application's page on the standalone master (kept after the application ends)."""

    name = "Spark master: application"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=SPARK_MASTER_APP_XCOM_KEY) or ""


class SparkHistoryServerLink(BaseOperatorLink):
    """The application's page on the Spark history server named by the connection (after the run too)."""

    name = "Spark History Server"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=SPARK_HISTORY_XCOM_KEY) or ""


class MlflowRunLink(BaseOperatorLink):
    """The task instance's run in the MLflow UI (``mlflow_conn_id``; see docs/tracking.md)."""

    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=MLFLOW_RUN_XCOM_KEY) or ""
