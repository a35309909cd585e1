"""``report()``: training code sends metrics to the Airflow task while it trains.

Each report appears in the task log as it happens, and the run's history comes back with the
output: the operator pushes it to XCom under the key ``metrics``.

A record is ``{"rank": 0, "step": 3, "time": 1767225600.123, "total_steps": 10, "loss": 0.12}``:
the fields in :data:`RECORD_FIELDS` describe the report (``total_steps`` only when given), every
other key is a metric.
"""

from __future__ import annotations

import math
import operator
import os
import time
from typing import Any

from airflow_provider_torchdist.spark.node import progress, rank_context
from airflow_provider_torchdist.spark.wire.logsafe import escape_controls
from airflow_provider_torchdist.spark.wire.protocol import Metric

#: The keys of a record that are not metrics; no metric may take one of these names.
RECORD_FIELDS = ("rank", "step", "time", "total_steps")


def _number(name: str, value: Any) -> float | int:
    if hasattr(value, "item"):  # a one-element tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"metric {name!r} must be a number or a one-element tensor, got {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        return float(value)  # still reported: a NaN loss is exactly what people need to see
    return value


def _total_steps(value: Any) -> int:
    """``total_steps`` as a positive int; an integer-valued numpy scalar or tensor is fine too."""
    try:
        if isinstance(value, bool):
            raise TypeError
        total = operator.index(value)
    except TypeError:
        raise TypeError(
            f"report(total_steps=...) must be a positive int (how many steps the run will take), "
            f"got {type(value).__name__} {value!r}"
        ) from None
    if total <= 0:
        raise ValueError(
            f"report(total_steps=...) must be a positive int (how many steps the run will take), got {total}"
        )
    return total


def report(
    step: int | None = None, *, total_steps: int | None = None, all_ranks: bool = False, **metrics: Any
) -> None:
    """Report metrics from inside the training function; by default only global rank 0 reports.

    ``total_steps``, when given, is how many steps the run will take (a positive int): the task
    log shows ``step 3/10``, and the record carries it; it is not a metric.

    Example::

        from airflow_provider_torchdist import report

        for step in range(steps):
            loss = train_step()
            report(step=step, total_steps=steps, loss=loss)   # tensors are fine
    """
    progress.note_progress()  # on every rank, reporting or not: the hang watchdog counts it
    total = None if total_steps is None else _total_steps(total_steps)
    reserved = [name for name in metrics if name in RECORD_FIELDS]
    if reserved:
        raise ValueError(
            f"report(): {', '.join(map(repr, reserved))} cannot be a metric name: "
            f"{', '.join(RECORD_FIELDS)} are the record's own fields"
        )
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and not all_ranks:
        return
    values = {name: _number(name, value) for name, value in metrics.items()}
    record: dict[str, Any] = {"rank": rank, "step": step, "time": round(time.time(), 3)}
    if total is not None:
        record["total_steps"] = total
    record.update(values)
    client = rank_context.get_client()
    if client is None or not client.send(Metric(record)):
        print(f"[metrics] {format_metrics(record)}", flush=True)


def format_metrics(record: dict[str, Any]) -> str:
    """``rank 0 step 3/10: loss=0.1234 acc=0.9``, as the task log shows a report."""
    values = " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in record.items()
        if k not in RECORD_FIELDS
    )
    step = ""
    if record.get("step") is not None:
        total = record.get("total_steps")
        step = f" step {record['step']}" + ("" if total is None else f"/{total}")
    # Names (and, from a crafted message, values) are the rank's text: one visible line, no escapes.
    return escape_controls(f"rank {record.get('rank')}{step}: {values}")
