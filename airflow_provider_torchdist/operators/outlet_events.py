"""What a successful run tells the assets in the operator's ``outlets``: the asset event's ``extra``.

With ``outlets=[Asset("torchdist://models/retrain")]``, Airflow emits an asset event for the
trained model when the task succeeds; :func:`set_outlet_extra` fills its ``extra`` (the Task SDK's
``context["outlet_events"][asset].extra``) with what :func:`run_extra` says of the run::

    {"metrics": {"loss": 0.0012}, "step": 59,              # rank 0's last report()
     "output_type": "dict", "output_format": "cloudpickle", "output_size": 1234,
     "output_ref": "file:///.../train-try1.pkl",             # only when stored at output_path
     "world_size": 2, "duration_s": 41.7}

Small and plain JSON: at most ``MAX_METRICS`` metric values, a NaN or infinite value as null. A
downstream DAG scheduled on the asset reads it from ``triggering_asset_events``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.providers.common.compat.sdk import Asset

from airflow_provider_torchdist.outputs.results import is_envelope
from airflow_provider_torchdist.spark.driver.stragglers import is_rank_summary
from airflow_provider_torchdist.spark.node.metrics import RECORD_FIELDS
from airflow_provider_torchdist.supervision.lifeline import RunStatus

#: The most metric values an event's extra carries (a report() of hundreds would bloat every event).
MAX_METRICS = 50


def final_metrics(history: list[dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """The metric values of rank 0's last record (any rank's when rank 0 reported none), and its step;
    a report's, never the ranks' step times the run adds at its end."""
    history = [r for r in history if not is_rank_summary(r)]
    last = next((r for r in reversed(history) if r.get("rank") == 0), history[-1] if history else None)
    if last is None:
        return {}, None
    values = {k: v for k, v in last.items() if k not in RECORD_FIELDS}
    return {k: _json_number(v) for k, v in list(values.items())[:MAX_METRICS]}, last.get("step")


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_extra(status: RunStatus, value: Any, world_size: int) -> dict[str, Any]:
    """The extra of the event a succeeded run emits (see the module docstring). ``value`` is what
    went to XCom: an envelope's ``ref`` says where a large output was stored."""
    metrics, step = final_metrics(status.metrics)
    extra: dict[str, Any] = {"metrics": metrics, "step": step}
    if status.output is not None:
        extra |= {
            "output_type": status.output["type"],
            "output_format": status.output["format"],
            "output_size": status.output["size"],
        }
        if is_envelope(value) and "ref" in value:
            extra["output_ref"] = value["ref"]
    return extra | {"world_size": world_size, "duration_s": status.elapsed_s}


def set_outlet_extra(context: Mapping[str, Any], outlets: Iterable[Any], extra: dict[str, Any]) -> None:
    """Put ``extra`` into the event of every asset in ``outlets`` (an alias names no asset: skipped),
    over what the task put there already."""
    events = context.get("outlet_events")
    if events is None:
        return
    for outlet in outlets:
        if isinstance(outlet, Asset):
            accessor = events[outlet]
            accessor.extra = {**accessor.extra, **extra}
