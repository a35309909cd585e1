"""The first step of decoding a JSON-line message, shared by the run channel and the lifeline.

Both protocols send one JSON object per line: the run channel's
(:mod:`~airflow_provider_torchdist.spark.wire.protocol`) and the lifeline's
(:mod:`~airflow_provider_torchdist.supervision.lifeline`). Each raises its own error for a line that is not
one. Standard library only.

Example::

    json_object(b'{"k": "bye"}\\n', ProtocolError)  # {"k": "bye"}
    json_object(b"[1]\\n", ProtocolError)           # ProtocolError: a message must be a JSON object, ...
"""

from __future__ import annotations

import json
from typing import Any


def json_object(raw: bytes | str, error: type[Exception]) -> dict[str, Any]:
    """The JSON object in one line; ``error`` (saying what is wrong) for anything else."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise error(f"not a JSON message: {exc}") from None
    if not isinstance(obj, dict):
        raise error(f"a message must be a JSON object, got {type(obj).__name__}")
    return obj
