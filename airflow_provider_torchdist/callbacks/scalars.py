"""What the framework callbacks pass to ``report()``: the numbers among a framework's values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from airflow_provider_torchdist.spark.node.metrics import RECORD_FIELDS


def scalar_metrics(values: Mapping[Any, Any]) -> dict[str, int | float]:
    """The entries of ``values`` that are numbers or one-element tensors, as Python numbers.

    Anything else (a string, a tensor of several elements, a name that is one of the record's
    own fields) is left out: a framework's log may hold all of these, and none is a metric.
    """
    found: dict[str, int | float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or name in RECORD_FIELDS:
            continue
        if hasattr(value, "item"):
            try:
                value = value.item()
            except (RuntimeError, ValueError):  # more than one element
                continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = value
    return found


def known_total(value: Any) -> int | None:
    """A framework's total step count when it knows one: Lightning says ``inf`` for an
    unbounded run, Hugging Face 0 or -1 before it has worked it out."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value <= 0 or value != int(value):
        return None
    return int(value)
