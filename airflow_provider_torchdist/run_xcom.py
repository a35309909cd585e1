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
from airflow_provider_torchdist.links import ApplicationLinks
from airflow_provider_torchdist.results import origin_of, output_to_xcom
from airflow_provider_torchdist.spec import TrainingSpec


def link_pusher(ti: Any) -> Callable[[ApplicationLinks], None]:
    """The hook's ``on_application`` that pushes the application's link URLs to ``ti``'s XCom."""

    def push_links(links: ApplicationLinks) -> None:
        # Pushed while the run goes on, so the extra links work before the task ends.
        for key, url in links.xcom_values().items():
            ti.xcom_push(key=key, value=url)

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
