"""Extra links on a training task: the run's Spark UI, and its page on a standalone master.

The operator pushes the URLs to XCom as soon as the driver reports them, so the buttons work
while the task runs (extra links are otherwise only computed at task end).
"""

from __future__ import annotations

from typing import Any

from airflow.providers.common.compat.sdk import BaseOperatorLink, XCom

SPARK_UI_XCOM_KEY = "spark_ui_url"
SPARK_MASTER_APP_XCOM_KEY = "spark_master_app_url"


class SparkUILink(BaseOperatorLink):
    """The Spark driver's web UI of the run (live while the application runs)."""

    name = "Spark UI"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=SPARK_UI_XCOM_KEY) or ""


class SparkMasterAppLink(BaseOperatorLink):
    """The application's page on the standalone master (kept after the application ends)."""

    name = "Spark master: application"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=SPARK_MASTER_APP_XCOM_KEY) or ""
