"""``report()``: training code sends metrics to the Airflow task while it trains.

Each report appears in the task log as it happens, and the run's history comes back with the
output: the operator pushes it to XCom under the key ``metrics``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from airflow_provider_torchdist.spark import rank_context
from airflow_provider_torchdist.spark.logsafe import escape_controls
from airflow_provider_torchdist.spark.protocol import Metric


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


def report(step: int | None = None, *, all_ranks: bool = False, **metrics: Any) -> None:
    """Report metrics from inside the training function; by default only global rank 0 reports.

    Example::

        from airflow_provider_torchdist import report

        for step in range(steps):
            loss = train_step()
            report(step=step, loss=loss)   # tensors are fine
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and not all_ranks:
        return
    values = {name: _number(name, value) for name, value in metrics.items()}
    record = {"rank": rank, "step": step, "time": round(time.time(), 3), **values}
    client = rank_context.get_client()
    if client is None or not client.send(Metric(record)):
        print(f"[metrics] {format_metrics(record)}", flush=True)


def format_metrics(record: dict[str, Any]) -> str:
    """``rank 0 step 3: loss=0.1234 acc=0.9``, as the task log shows a report."""
    values = " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in record.items()
        if k not in ("rank", "step", "time")
    )
    step = "" if record.get("step") is None else f" step {record['step']}"
    # Names (and, from a crafted message, values) are the rank's text: one visible line, no escapes.
    return escape_controls(f"rank {record.get('rank')}{step}: {values}")
