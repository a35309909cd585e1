"""The output envelope: how rank 0's return value travels through XCom.

Airflow 3 XCom holds JSON only (no pickling; bytes, arrays and tensors are refused). So:

- a JSON-native value (None, bool, int, finite float, str, and lists / str-keyed dicts of them)
  goes to XCom as it is;
- anything else goes as an envelope, a small dict::

      {"__torchdist_output__": 1,          # envelope format version
       "format": "cloudpickle",
       "type": "torch.Tensor",             # the value's type, for people reading XCom in the UI
       "size": 1234,                       # bytes of the pickle
       "data": "<base64 of the pickle>"}

:func:`load_output` turns either back into the Python object, so downstream tasks call it on
whatever they receive.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import cloudpickle

ENVELOPE_KEY = "__torchdist_output__"
ENVELOPE_VERSION = 1


def is_json_native(value: Any) -> bool:
    """True when XCom's JSON round trip gives back an equal value of the same types."""
    # Exact types: a subclass (an IntEnum, say) would come back from JSON as its base type.
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(is_json_native(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) for k in value) and all(is_json_native(v) for v in value.values())
    return False


def envelope(pickled: bytes, value: Any) -> dict[str, Any]:
    """Wrap a pickled value for XCom."""
    return {
        ENVELOPE_KEY: ENVELOPE_VERSION,
        "format": "cloudpickle",
        "type": f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins."),
        "size": len(pickled),
        "data": base64.b64encode(pickled).decode("ascii"),
    }


def to_xcom(pickled: bytes | None) -> Any:
    """What the operator returns (and Airflow pushes to XCom) for rank 0's pickled value."""
    if pickled is None:
        return None
    value = cloudpickle.loads(pickled)
    return value if is_json_native(value) else envelope(pickled, value)


def load_output(value: Any) -> Any:
    """Rank 0's return value, as the same Python object, from what XCom handed a downstream task.

    Plain JSON values come back unchanged; an envelope is decoded.

    Example::

        @task
        def evaluate(value):
            model_state = load_output(value)
    """
    if not (isinstance(value, dict) and ENVELOPE_KEY in value):
        return value
    version = value.get(ENVELOPE_KEY)
    if version != ENVELOPE_VERSION or value.get("format") != "cloudpickle":
        raise ValueError(
            f"Unsupported torchdist output envelope (version {version!r}, format {value.get('format')!r}); "
            "upgrade airflow-provider-torchdist where this task runs."
        )
    return cloudpickle.loads(base64.b64decode(value["data"]))
