"""The output envelope: how rank 0's return value travels through XCom, signed and bound to its origin.

Airflow 3 XCom holds JSON only. So:

- a JSON-native value (None, bool, int, finite float, str, lists / str-keyed dicts of them) goes to
  XCom as it is. Forging one cannot run code: :func:`load_output` returns it unchanged;
- anything else goes as a version 2 envelope, a small dict::

      {"__torchdist_output__": 2,
       "format": "cloudpickle",          # or "json": a JSON value stored by reference
       "type": "torch.Tensor",           # the value's type, as rank 0 named it
       "size": 1234,                     # bytes of the encoded value
       "sha256": "<hex>",                # their digest
       "data": "<base64>",               # the bytes inline, or, above max_xcom_output_bytes:
       "ref": "file:///.../output.pkl",  #   where they are stored (any ObjectStoragePath URI)
       "origin": {"dag_id": ..., "run_id": ..., "task_id": ..., "map_index": -1, "try": 1},
       "sig": "<hex HMAC-SHA256>"}

The signature (:mod:`airflow_provider_torchdist.outputs.signing`) covers a canonical encoding of every
field but ``data`` (whose digest it covers): version, format, type, size, digest, where the bytes
are (inline, or the reference), and the origin. :func:`load_output` checks the envelope's shape,
every field's type, the version, the format and the signature before it decodes anything, and with
``expect=`` that the value comes from where the caller says it must.

The Airflow worker never unpickles: rank 0 decided the format, the driver's manifest says it, a
JSON output is parsed as JSON, and a pickle is signed as bytes. Version 1 envelopes (before 0.2)
are refused: their signature did not cover every field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_torchdist.outputs.signing import sign, signing_key, verify
from airflow_provider_torchdist.outputs.storage import (
    VerifiedChunks,
    local_path,
    open_stored,
    store_local,
    store_remote,
)
from airflow_provider_torchdist.spark.wire.output_store import (
    FORMAT_JSON,
    FORMAT_PICKLE,
    FORMATS,
    OutputManifest,
    decode_json,
    is_json_native,
)

__all__ = ["OutputSignatureError", "is_json_native", "load_output", "output_origin", "output_to_xcom"]

ENVELOPE_KEY = "__torchdist_output__"
ENVELOPE_VERSION = 2
DEFAULT_MAX_XCOM_OUTPUT_BYTES = 4 * 1024 * 1024
ORIGIN_FIELDS = ("dag_id", "run_id", "task_id", "map_index", "try")
_BASE_FIELDS = {ENVELOPE_KEY, "format", "type", "size", "sha256", "origin", "sig"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class OutputSignatureError(ValueError):
    """An envelope this deployment did not sign, or not for this reader: refused before decoding."""


def _refused(why: str) -> OutputSignatureError:
    return OutputSignatureError(
        f"Refusing to load this torchdist output: {why}. It was changed after the training task wrote "
        "it (XCom can be written through the REST API), its stored file changed, or it comes from a "
        "deployment with another [torchdist] output_signing_key. Re-run the training task."
    )


def origin_of(ti: Any) -> dict[str, Any]:
    """The origin fields of a task instance: where an output it produced comes from."""
    map_index = getattr(ti, "map_index", -1)
    return {
        "dag_id": str(ti.dag_id),
        "run_id": str(ti.run_id),
        "task_id": str(ti.task_id),
        "map_index": -1 if map_index is None else int(map_index),
        "try": int(ti.try_number),
    }


def _signed_fields(env: dict[str, Any]) -> list[Any]:
    where = ["data", ""] if "data" in env else ["ref", env["ref"]]
    origin = [env["origin"][k] for k in ORIGIN_FIELDS]
    return [
        "torchdist-output",
        env[ENVELOPE_KEY],
        env["format"],
        env["type"],
        env["size"],
        env["sha256"],
        *where,
        *origin,
    ]


def _envelope(fields: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    env = {ENVELOPE_KEY: ENVELOPE_VERSION, **fields}
    env["sig"] = sign(key or signing_key(), _signed_fields(env))
    return env


def output_to_xcom(
    path: Path | None,
    *,
    origin: dict[str, Any],
    max_inline_bytes: int,
    store_uri: str,
    store_base: str | None = None,
    key: bytes | None = None,
) -> Any:
    """What the operator returns (and Airflow pushes to XCom) for rank 0's output file.

    Reads the driver's manifest for the file, never unpickles it: a small JSON output is returned as
    the value itself, a small pickle inline in a signed envelope, and anything above
    ``max_inline_bytes`` is stored at ``store_uri`` (moved when local and on the same filesystem)
    with a signed reference in XCom. ``store_base``: the configured ``output_path`` that
    ``store_uri`` lies under; no symlink below it is followed.
    """
    if path is None:
        return None
    manifest = OutputManifest.read(path)
    if manifest is None:
        raise RuntimeError(
            f"rank 0's output at {path} has no valid manifest from the driver; it is not used. "
            "This is a bug or tampering with the run's staging directory."
        )
    fields = {
        "format": manifest.format,
        "type": manifest.type,
        "size": manifest.size,
        "sha256": manifest.sha256,
        "origin": dict(origin),
    }
    if manifest.size <= max_inline_bytes:
        data = path.read_bytes()
        if len(data) != manifest.size or hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise RuntimeError(f"rank 0's output at {path} does not match its manifest; it is not used.")
        if manifest.format == FORMAT_JSON:
            value = decode_json(data)
            # A dict that looks like an envelope would be mistaken for one downstream: wrap it.
            if is_json_native(value) and not (isinstance(value, dict) and ENVELOPE_KEY in value):
                return value
        return _envelope({**fields, "data": base64.b64encode(data).decode("ascii")}, key)
    from airflow.sdk import ObjectStoragePath

    dest = ObjectStoragePath(store_uri)
    local = local_path(dest)
    if local is not None:
        base = local_path(ObjectStoragePath(store_base)) if store_base else None
        store_local(path, local, base if base is not None and local.is_relative_to(base) else local.parent)
    else:
        store_remote(path, dest)
    return _envelope({**fields, "ref": str(dest)}, key)


def _check_shape(value: dict[str, Any]) -> None:
    """Every field present, of its type, non-empty; nothing unknown. Raises before any crypto or decoding."""
    version = value.get(ENVELOPE_KEY)
    if version == 1:
        raise _refused(
            "it is a version 1 envelope, written by airflow-provider-torchdist before 0.2, whose signature "
            "did not cover every field; version 1 is no longer accepted"
        )
    if type(version) is not int or version != ENVELOPE_VERSION:
        raise _refused(
            f"unknown envelope version {version!r} (this provider reads version {ENVELOPE_VERSION})"
        )
    where = {"data"} if "data" in value else {"ref"}
    if set(value) != _BASE_FIELDS | where:
        missing = sorted(_BASE_FIELDS | where - set(value))
        extra = sorted(set(value) - _BASE_FIELDS - where)
        raise _refused(f"malformed envelope (missing {missing}, unexpected {extra})")
    if value["format"] not in FORMATS:
        raise _refused(f"unknown format {value['format']!r}")
    problems = [
        name
        for name, ok in (
            ("type", isinstance(value["type"], str) and value["type"] != ""),
            ("size", type(value["size"]) is int and value["size"] >= 0),
            ("sha256", isinstance(value["sha256"], str) and _HEX64.fullmatch(value["sha256"])),
            ("sig", isinstance(value["sig"], str) and _HEX64.fullmatch(value["sig"])),
            ("data", "data" not in value or (isinstance(value["data"], str) and value["data"] != "")),
            ("ref", "ref" not in value or (isinstance(value["ref"], str) and value["ref"] != "")),
            ("origin", _origin_ok(value["origin"])),
        )
        if not ok
    ]
    if problems:
        raise _refused(f"malformed envelope: bad or empty {', '.join(problems)}")


def _origin_ok(origin: Any) -> bool:
    if not isinstance(origin, dict) or set(origin) != set(ORIGIN_FIELDS):
        return False
    strings = all(isinstance(origin[k], str) and origin[k] != "" for k in ("dag_id", "run_id", "task_id"))
    ints = all(type(origin[k]) is int for k in ("map_index", "try"))
    return strings and ints and origin["map_index"] >= -1 and origin["try"] >= 0


def is_envelope(value: Any) -> bool:
    """True for anything that claims to be a torchdist envelope (it must then verify)."""
    return isinstance(value, dict) and ENVELOPE_KEY in value


def output_origin(value: Any) -> dict[str, Any] | None:
    """Where a verified envelope's value comes from: ``{"dag_id", "run_id", "task_id", "map_index", "try"}``.

    None for a plain JSON value, which carries no origin. Raises :class:`OutputSignatureError` for an
    envelope that does not verify.
    """
    if not is_envelope(value):
        return None
    _check_shape(value)
    if not verify(signing_key(), _signed_fields(value), value["sig"]):
        raise _refused("its signature does not match this deployment's key")
    return dict(value["origin"])


def load_output(value: Any, expect: dict[str, Any] | None = None) -> Any:
    """Rank 0's return value, as the same Python object, from what XCom handed a downstream task.

    Plain JSON values come back unchanged. An envelope is checked (shape, types, version, format,
    signature, and with ``expect`` its origin), then decoded, following its reference for large
    outputs. ``expect`` holds origin fields the value must have come from, e.g.
    ``{"dag_id": "retrain", "run_id": context["run_id"]}``: an envelope replayed from another run is
    refused. A plain JSON value has no origin, so ``expect`` refuses it too.

    Example::

        @task
        def evaluate(value, run_id=None):
            model_state = load_output(value, expect={"run_id": run_id})
    """
    if not is_envelope(value):
        if expect:
            raise OutputSignatureError(
                "This value is plain JSON, not a signed torchdist envelope, so where it comes from cannot "
                f"be checked against expect={expect!r}. Plain JSON outputs are not signed (forging one "
                "cannot run code); call load_output without expect to take it as it is."
            )
        return value
    origin = output_origin(value)
    assert origin is not None
    for field, wanted in (expect or {}).items():
        if field not in ORIGIN_FIELDS:
            raise ValueError(f"expect has an unknown field {field!r}; use some of {list(ORIGIN_FIELDS)}")
        if origin[field] != wanted:
            raise OutputSignatureError(
                f"Refusing this torchdist output: it comes from {field}={origin[field]!r}, not the expected "
                f"{wanted!r} (origin {origin}). An output of another run was put in this XCom."
            )
    size, digest = value["size"], value["sha256"]

    def check(actual: str) -> None:
        if actual != digest:
            raise _refused("its bytes do not match the signed digest")

    if "data" in value:
        try:
            data = base64.b64decode(value["data"], validate=True)
        except (binascii.Error, ValueError):
            raise _refused("its data is not valid base64") from None
        if len(data) != size:
            raise _refused("its data is not the size that was signed")
        check(hashlib.sha256(data).hexdigest())
        return decode_json(data) if value["format"] == FORMAT_JSON else cloudpickle.loads(data)
    from airflow.sdk import ObjectStoragePath

    with open_stored(ObjectStoragePath(value["ref"])) as stream:
        verified = VerifiedChunks.from_stream(stream, size, check, _refused)
    if value["format"] == FORMAT_JSON:
        return decode_json(verified.read())
    assert value["format"] == FORMAT_PICKLE
    return cloudpickle.load(verified)
