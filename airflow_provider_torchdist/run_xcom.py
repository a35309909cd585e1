"""What the operator puts in XCom while it owns a run: the extra links' URLs as soon as the driver
reports them, and rank 0's output as the task's value.

:func:`link_pusher` is the hook's ``on_application`` for a task instance; :func:`output_handler`
is what the hook's ``follow`` hands rank 0's output file to
(:func:`~airflow_provider_torchdist.results.output_to_xcom`: inline, or stored and signed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist import run_paths
from airflow_provider_torchdist.links import SPARK_MASTER_APP_XCOM_KEY, SPARK_UI_XCOM_KEY
from airflow_provider_torchdist.results import origin_of, output_to_xcom
from airflow_provider_torchdist.spec import TrainingSpec


def link_pusher(ti: Any) -> Callable[[str, str | None, str | None], None]:
    """The hook's ``on_application`` that pushes the Spark UI and master page URLs to ``ti``'s XCom."""

    def push_links(app_id: str, ui: str | None, master_page: str | None) -> None:
        # Pushed while the run goes on, so the extra links work before the task ends.
        if ui:
            ti.xcom_push(key=SPARK_UI_XCOM_KEY, value=ui)
        if master_page:
            ti.xcom_push(key=SPARK_MASTER_APP_XCOM_KEY, value=master_page)

    return push_links


def output_handler(ti: Any, spec: TrainingSpec) -> Callable[[Path | None], Any]:
    """What turns rank 0's output file into ``ti``'s XCom value, under ``spec``'s output settings."""
    store_uri = run_paths.output_uri(spec.output_path, ti)
    return lambda path: output_to_xcom(
        path,
        origin=origin_of(ti),
        max_inline_bytes=spec.max_xcom_output_bytes,
        store_uri=store_uri,
        store_base=run_paths.output_base(spec.output_path),
    )
