"""The output envelope: how rank 0's return value travels through XCom.

Airflow 3 XCom holds JSON only (no pickling; bytes, arrays and tensors are refused). So:

- a JSON-native value (None, bool, int, finite float, str, and lists / str-keyed dicts of them)
  goes to XCom as it is;
- anything else goes as an envelope, a small dict::

      {"__torchdist_output__": 1,          # envelope format version
       "format": "cloudpickle",
       "type": "torch.Tensor",             # the value's type, for people reading XCom in the UI
       "size": 1234,                       # bytes of the pickle
       "data": "<base64 of the pickle>",   # or, above max_xcom_output_bytes, instead of data:
       "ref": "file:///.../output.pkl",    #   where the pickle was stored (any ObjectStoragePath URI)
       "sha256": "<hex>",                  #   and its digest
       "sig": "<hex HMAC-SHA256>"}         # signed with this deployment's key

:func:`load_output` turns either back into the Python object, so downstream tasks call it on
whatever they receive. It checks the signature before it unpickles anything: XCom can be written
through Airflow's REST API, and unpickling what someone else wrote there would run their code.

The signing key is ``[torchdist] output_signing_key`` in Airflow's configuration (so also the
``AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY`` variable, ``_CMD`` and ``_SECRET`` forms, or a secrets
backend). Without one, a random key is created once in ``$AIRFLOW_HOME/torchdist_output_signing.key``
(mode 0600), which serves an embedded deployment whose processes share ``AIRFLOW_HOME``. Deployments
on several machines must configure the same key on every worker.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import secrets
from pathlib import Path
from typing import Any

import cloudpickle

ENVELOPE_KEY = "__torchdist_output__"
ENVELOPE_VERSION = 1
KEY_FILE = "torchdist_output_signing.key"
DEFAULT_MAX_XCOM_OUTPUT_BYTES = 4 * 1024 * 1024
_COPY_CHUNK = 8 * 1024 * 1024


class OutputSignatureError(ValueError):
    """An envelope that this deployment did not sign: refused before anything is unpickled."""


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


def signing_key() -> bytes:
    """This deployment's output signing key (see the module docstring for where it comes from)."""
    from airflow.configuration import conf

    configured = conf.get("torchdist", "output_signing_key", fallback=None)
    if configured:
        return configured.encode()
    path = Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser() / KEY_FILE
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    return path.read_bytes().strip()


def _signature(key: bytes, fields: dict[str, Any], digest: str) -> str:
    signed = "\n".join(
        [f"v{fields[ENVELOPE_KEY]}", fields["format"], str(fields["size"]), fields.get("ref", ""), digest]
    )
    return hmac.new(key, signed.encode(), hashlib.sha256).hexdigest()


def envelope(pickled: bytes, value: Any, key: bytes | None = None) -> dict[str, Any]:
    """Wrap a pickled value for XCom, inline and signed."""
    fields: dict[str, Any] = {
        ENVELOPE_KEY: ENVELOPE_VERSION,
        "format": "cloudpickle",
        "type": _type_name(value),
        "size": len(pickled),
        "data": base64.b64encode(pickled).decode("ascii"),
    }
    fields["sig"] = _signature(key or signing_key(), fields, hashlib.sha256(pickled).hexdigest())
    return fields


def reference(uri: str, size: int, digest: str, key: bytes | None = None) -> dict[str, Any]:
    """A signed envelope that points at a pickle stored elsewhere (for outputs too big for XCom)."""
    fields: dict[str, Any] = {
        ENVELOPE_KEY: ENVELOPE_VERSION,
        "format": "cloudpickle",
        "size": size,
        "ref": uri,
        "sha256": digest,
    }
    fields["sig"] = _signature(key or signing_key(), fields, digest)
    return fields


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def to_xcom(pickled: bytes | None) -> Any:
    """What the operator returns (and Airflow pushes to XCom) for rank 0's pickled value."""
    if pickled is None:
        return None
    value = cloudpickle.loads(pickled)
    return value if is_json_native(value) else envelope(pickled, value)


def output_to_xcom(path: Path | None, *, max_inline_bytes: int, store_uri: str) -> Any:
    """Like :func:`to_xcom`, from the output file; above ``max_inline_bytes`` the pickle is copied,
    streaming and never unpickled here, to ``store_uri`` and XCom gets a signed reference."""
    if path is None:
        return None
    size = path.stat().st_size
    if size <= max_inline_bytes:
        return to_xcom(path.read_bytes())
    from airflow.sdk import ObjectStoragePath

    dest = ObjectStoragePath(store_uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(path, "rb") as src, dest.open("wb") as out:
        while chunk := src.read(_COPY_CHUNK):
            digest.update(chunk)
            out.write(chunk)
    return reference(str(dest), size, digest.hexdigest())


def load_output(value: Any) -> Any:
    """Rank 0's return value, as the same Python object, from what XCom handed a downstream task.

    Plain JSON values come back unchanged; an envelope's signature is checked, then it is decoded
    (following its reference for large outputs).

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
    if "ref" in value:
        from airflow.sdk import ObjectStoragePath

        pickled = ObjectStoragePath(value["ref"]).read_bytes()
    else:
        pickled = base64.b64decode(value.get("data", ""))
    digest = hashlib.sha256(pickled).hexdigest()
    expected = _signature(signing_key(), value, digest) if "size" in value else ""
    if not isinstance(value.get("sig"), str) or not hmac.compare_digest(value["sig"], expected):
        raise OutputSignatureError(
            "Refusing to unpickle this torchdist output: its signature does not match this deployment's "
            "key. It was changed after the training task wrote it (XCom can be written through the REST "
            "API), its stored file changed, or it comes from a deployment with another "
            "[torchdist] output_signing_key. Re-run the training task."
        )
    return cloudpickle.loads(pickled)
