"""``set_output()``: what a training script or module hands to the tasks after it.

A callable's rank 0 return value is the task's XCom value; a script has no return value, so its
rank 0 calls :func:`set_output` instead, and the value travels exactly as a callable's would:
encoded by rank 0 (JSON when JSON-native, else a pickle), signed by the operator, pushed to XCom,
read with :func:`~airflow_provider_torchdist.load_output`.

:func:`~airflow_provider_torchdist.spark.node.rank.run_rank` says which kind of work runs
(:func:`begin`) and takes the value when the script ends (:func:`taken`).
"""

from __future__ import annotations

import os
from typing import Any

_kind: str | None = None
_value: Any = None


def set_output(value: Any) -> None:
    """Hand ``value`` to the tasks after this one, from a training script or module.

    Example (the end of ``train.py``)::

        from airflow_provider_torchdist import set_output

        torch.save(model.state_dict(), path)
        set_output({"model_path": path, "loss": loss.item()})

    Every rank may call it: only global rank 0's value is kept (on other ranks it does nothing),
    as only rank 0's return value is kept from a callable. Calling it again replaces the value; what
    the task pushes is the last value set when the script ends (None if it never calls it). The
    value is encoded when the script ends, so mutating it afterwards changes what is sent. Outside
    a run (``python train.py``), it keeps the value and does nothing else.

    Raises :class:`RuntimeError` in a training *callable*: its return value is the output there.
    """
    global _value
    if _kind == "callable":
        raise RuntimeError(
            "set_output() is for training scripts and modules: a training callable hands on its "
            "return value. Return the value from the function instead."
        )
    if os.environ.get("RANK", "0") == "0":
        _value = value


def begin(kind: str) -> None:
    """A rank starts ``kind`` work (``"callable"``, ``"script"`` or ``"module"``): nothing set yet."""
    global _kind, _value
    _kind, _value = kind, None


def taken() -> Any:
    """The value rank 0 set (None if none), and forget it."""
    global _value
    value, _value = _value, None
    return value
