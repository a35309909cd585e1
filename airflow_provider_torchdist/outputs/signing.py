"""The deployment's output signing key, and HMAC-SHA256 over a canonical encoding.

The key is ``[torchdist] output_signing_key`` in Airflow's configuration (so also the
``AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY`` variable, its ``_CMD`` and ``_SECRET`` forms, a
secrets backend: :mod:`.key_sources`; a form that is set but yields nothing is refused). Without
one, a random key is created once in ``$AIRFLOW_HOME/torchdist_output_signing.key``, which serves
an embedded deployment whose processes share ``AIRFLOW_HOME``. Deployments on several machines must
configure the same key on every worker.

The Training view's API server needs less: :func:`view_status_key`, derived from the key for status
queries only (``[torchdist] view_status_key``, printed by ``python -m airflow_provider_torchdist
status-key``), cannot sign outputs nor own a run.

Rules, each refused with a message that says how to fix it:

- a key has at least 32 bytes;
- the key file is a regular file owned by this user, mode 0600 (no group or other access);
- the key file is created atomically (written to a temporary name, then linked into place), so no
  process ever reads an empty or partial key.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.outputs.key_sources import SigningKeyError, read_key_option

__all__ = [
    "SigningKeyError",
    "canonical",
    "sign",
    "signing_key",
    "status_view_key",
    "verify",
    "view_status_key",
]

KEY_FILE = "torchdist_output_signing.key"
MIN_KEY_BYTES = 32
_HOW_TO_SET = (
    "Set [torchdist] output_signing_key to at least 32 random bytes on every Airflow worker, e.g. "
    "AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')"
)


def _key_file() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser() / KEY_FILE


def signing_key(create: bool = True) -> bytes:
    """This deployment's output signing key (see the module docstring for where it comes from).
    ``create=False``: a machine that only checks (the API server) never makes a key of its own,
    which could not match the workers'; it gets :class:`SigningKeyError` instead."""
    configured = read_key_option("output_signing_key")
    if configured.value:
        where = configured.source.name if configured.source else "[torchdist] output_signing_key"
        return _long_enough(configured.value.strip().encode(), where)
    path = _key_file()
    try:
        return _read_key_file(path)
    except FileNotFoundError:
        if not create:
            raise SigningKeyError(
                f"No output signing key: none configured, and no {path}. {_HOW_TO_SET}."
            ) from None
    _create_key_file(path)
    return _read_key_file(path)


def _long_enough(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"The output signing key in {where} has {len(key)} bytes; it needs at least 32. {_HOW_TO_SET}."
        )
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise SigningKeyError(
            f"The output signing key file {path} is a symlink; it must be a regular file. Replace it with "
            f"the file itself (mode 0600). {_HOW_TO_SET}."
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SigningKeyError(
                f"The output signing key file {path} must be a regular file owned by this user "
                f"(uid {os.geteuid()}) with mode 0600; it is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}. Run: chown $(id -u) {path} && chmod 600 {path}, or "
                f"delete it to have a new key made. {_HOW_TO_SET}."
            )
        return _long_enough(f.read().strip(), str(path))


def _create_key_file(path: Path) -> None:
    """Write a new random key to a private temporary file, then link it into place.

    ``os.link`` fails when ``path`` exists, so of several processes racing here exactly one key wins
    and every process reads that complete key.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{KEY_FILE}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: use theirs
            pass
    finally:
        os.unlink(tmp)


def canonical(fields: list[Any]) -> bytes:
    """One unambiguous byte string for a list of JSON scalars: what a signature covers."""
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def sign(key: bytes, fields: list[Any]) -> str:
    """Hex HMAC-SHA256 of the canonical encoding of ``fields``."""
    return hmac.new(key, canonical(fields), hashlib.sha256).hexdigest()


def verify(key: bytes, fields: list[Any], signature: str) -> bool:
    """True when ``signature`` is :func:`sign` of ``fields`` under ``key``."""
    return hmac.compare_digest(sign(key, fields), signature)


#: What :func:`status_view_key` derives with: no other key of this provider uses it.
STATUS_VIEW_DOMAIN = b"torchdist-status-view"


def status_view_key(key: bytes) -> bytes:
    """The status-only key derived from the output signing key ``key``: what
    ``[torchdist] view_status_key`` holds (hex). It lets the Training view query runs' status
    (:func:`~airflow_provider_torchdist.supervision.record.status_secret`) and nothing else: the
    signing key cannot be recovered from it."""
    return hmac.new(key, STATUS_VIEW_DOMAIN, hashlib.sha256).digest()


def view_status_key() -> bytes | None:
    """What the Training view asks supervisors for status with: ``[torchdist] view_status_key``
    when set (refused unless it is the 64 hex characters ``status-key`` prints), else derived from
    this machine's output signing key if it has one (never made here); None when neither."""
    configured = read_key_option("view_status_key")
    if configured.value:
        try:
            key = bytes.fromhex(configured.value.strip())
        except ValueError:
            key = b""
        if len(key) != 32:
            where = configured.source.name if configured.source else "[torchdist] view_status_key"
            raise SigningKeyError(
                f"{where} must be the 64 hex characters that `python -m airflow_provider_torchdist "
                "status-key` prints on a worker (it has the output signing key)."
            )
        return key
    try:
        return status_view_key(signing_key(create=False))
    except (SigningKeyError, OSError):
        return None
