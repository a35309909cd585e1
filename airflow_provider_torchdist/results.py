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

A large output is hashed once on its way: rank 0 hashes its pickle while writing it and the driver
records that digest beside the file it receives, so the Airflow side signs without reading the file
again, and moves it into ``output_path`` with a rename when that is on the same filesystem as the
staging directory. ``load_output`` reads a stored pickle once, hashing as it reads, checks the
signature, and only then unpickles it from that in-memory copy, letting each part go once it is
consumed. Rank 0 pickles tensors from their own memory and they are loaded into the buffers the
unpickler reads them into (:mod:`airflow_provider_torchdist.spark.storage_pickling`), so neither
side holds the value twice.

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
import json
import math
import os
import secrets
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import cloudpickle

from airflow_provider_torchdist.spark.jobspec import OUTPUT_DIGEST_SUFFIX

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
    """Like :func:`to_xcom`, from the output file; above ``max_inline_bytes`` the pickle is stored,
    never unpickled here, at ``store_uri`` and XCom gets a signed reference.

    The file is moved (a rename) when ``store_uri`` is a local path on the staging directory's
    filesystem, else streamed there; the digest the run recorded is used when it matches the file.
    """
    if path is None:
        return None
    size = path.stat().st_size
    if size <= max_inline_bytes:
        return to_xcom(path.read_bytes())
    from airflow.sdk import ObjectStoragePath

    dest = ObjectStoragePath(store_uri)
    digest = recorded_digest(path)
    local = _local_path(dest)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        if digest is None:
            digest = _file_digest(path)
        if _move_within_filesystem(path, local):
            return reference(str(dest), size, digest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    hasher = None if digest else hashlib.sha256()
    with open(path, "rb") as src, dest.open("wb") as out:
        while chunk := src.read(_COPY_CHUNK):
            if hasher:
                hasher.update(chunk)
            out.write(chunk)
    return reference(str(dest), size, digest or hasher.hexdigest())  # type: ignore[union-attr]


def recorded_digest(path: Path) -> str | None:
    """The sha256 the run recorded for the output file at ``path``, if it still describes that file.

    The driver writes it beside the pickle (``output.pkl.sha256``) from the digest rank 0 computed
    while pickling. A record whose size, inode or mtime differ from the file's (a restarted worker
    group's newer output, say) is ignored, and the file is hashed instead.
    """
    try:
        record = json.loads(path.with_name(path.name + OUTPUT_DIGEST_SUFFIX).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if [record.get("size"), record.get("ino"), record.get("mtime_ns")] != [
        st.st_size,
        st.st_ino,
        st.st_mtime_ns,
    ]:
        return None
    digest = record.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _local_path(dest: Any) -> Path | None:
    """The local filesystem path of an ``ObjectStoragePath``, or None for remote storage."""
    return Path(dest.path) if dest.protocol in ("", "file", "local") else None


def _move_within_filesystem(src: Path, dest: Path) -> bool:
    """Rename ``src`` to ``dest`` (replacing it) when both are on one filesystem; False otherwise."""
    if os.stat(src.parent).st_dev != os.stat(dest.parent).st_dev:
        return False
    try:
        os.replace(src, dest)
    except OSError:  # EXDEV behind a bind mount, or the like: fall back to a copy
        return False
    return True


class VerifiedChunks:
    """A stored pickle read once into chunks, verified, then read by the unpickler chunk by chunk.

    Each chunk is let go as soon as the unpickler has consumed it, so the bytes and the object
    built from them are not both held whole: loading a 1 GB output peaks near 1 GB, not 2 GB.
    """

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = deque(chunks)
        self._pos = 0  # into the first chunk

    @classmethod
    def from_stream(cls, stream: BinaryIO, size: int, check: Callable[[str], None]) -> VerifiedChunks:
        """Read exactly ``size`` bytes, hashing them as they arrive; ``check(hexdigest)`` must pass
        before anything is returned. A stream of another length is refused."""
        chunks: list[bytes] = []
        digest = hashlib.sha256()
        got = 0
        while got < size:
            chunk = stream.read(min(_COPY_CHUNK, size - got))
            if not chunk:
                break
            digest.update(chunk)
            chunks.append(chunk)
            got += len(chunk)
        if got != size or stream.read(1):
            raise OutputSignatureError(
                _REFUSED + f" (The stored file is not the {size} bytes that were signed.)"
            )
        check(digest.hexdigest())
        return cls(chunks)

    # -- the file interface pickle.load uses -------------------------------------------------------

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._chunks:
            chunk = self._chunks[0]
            n = min(len(out) - done, len(chunk) - self._pos)
            out[done : done + n] = memoryview(chunk)[self._pos : self._pos + n]
            done += n
            self._pos += n
            if self._pos == len(chunk):
                self._chunks.popleft()
                self._pos = 0
        return done

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        if size < 0:
            size = sum(len(c) for c in self._chunks) - self._pos
        out = bytearray(size)
        return bytes(out[: self.readinto(out)])

    def readline(self) -> bytes:
        line = bytearray()
        while self._chunks:
            chunk = self._chunks[0]
            end = chunk.find(b"\n", self._pos)
            stop = len(chunk) if end < 0 else end + 1
            line += chunk[self._pos : stop]
            self._pos = stop
            if self._pos == len(chunk):
                self._chunks.popleft()
                self._pos = 0
            if end >= 0:
                break
        return bytes(line)


_REFUSED = (
    "Refusing to unpickle this torchdist output: its signature does not match this deployment's "
    "key. It was changed after the training task wrote it (XCom can be written through the REST "
    "API), its stored file changed, or it comes from a deployment with another "
    "[torchdist] output_signing_key. Re-run the training task."
)


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
    key = signing_key()

    def check(digest: str) -> None:
        expected = _signature(key, value, digest) if "size" in value else ""
        if not isinstance(value.get("sig"), str) or not hmac.compare_digest(value["sig"], expected):
            raise OutputSignatureError(_REFUSED)

    if "ref" not in value:
        pickled = base64.b64decode(value.get("data", ""))
        check(hashlib.sha256(pickled).hexdigest())
        return cloudpickle.loads(pickled)
    size = value.get("size")
    if not isinstance(size, int) or size < 0:
        raise OutputSignatureError(_REFUSED)
    # The signature covers ref, size and digest: refuse a forged reference before opening anything.
    check(str(value.get("sha256", "")))
    from airflow.sdk import ObjectStoragePath

    stored = ObjectStoragePath(value["ref"])
    local = _local_path(stored)
    with open(local, "rb", buffering=0) if local is not None else stored.open("rb") as stream:
        verified = VerifiedChunks.from_stream(stream, size, check)
    return cloudpickle.load(verified)
