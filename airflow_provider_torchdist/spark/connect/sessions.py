"""The Connect sessions a run uses: one shared by this user's runs against a server (its Python
workers stay up, torch imported), kept in a private cache, or the URL's own."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.wire.connect_ids import canonical_uuid
from airflow_provider_torchdist.spark.wire.private_files import write_private_text


def session_cache() -> Path:
    """Where this user keeps the ids of the Connect sessions its runs share (one per server and token)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "airflow-provider-torchdist" / "connect-sessions"


def with_session(url: str, session_id: str) -> str:
    """``url`` with ``session_id`` among its parameters."""
    return f"{url};session_id={session_id}" if "/;" in url else f"{url.rstrip('/')}/;session_id={session_id}"


def shared_session_id(url: str, cache: Path, renew: bool = False) -> str:
    """The session this user's runs against ``url`` share (a new one when ``renew`` or none yet).

    Spark Connect keeps Python workers per session: runs that share one find the server's workers
    up, torch imported, instead of starting them (about 1.4 s a run). The key covers the URL with
    its token, so different credentials never share a session.
    """
    path = cache / hashlib.sha256(f"{os.getuid()}|{url}".encode()).hexdigest()[:32]
    if not renew:
        with contextlib.suppress(OSError, ValueError):
            return str(uuid.UUID(path.read_text().strip(), version=4))
    session_id = str(uuid.uuid4())
    with contextlib.suppress(OSError):  # no cache: this run's session only
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private_text(path, session_id)
    return session_id


def planned_session_id(url: str) -> str | None:
    """The session a run against ``url`` will open (:func:`open_session`, unless the server closed
    it): the URL's own ``session_id``, or this user's shared one. None when the URL's is no UUID."""
    for param in url.partition("/;")[2].split(";"):
        name, _, value = param.partition("=")
        if name == "session_id":
            return canonical_uuid(value)
    return shared_session_id(url, session_cache())


def open_session(url: str) -> Any:
    """A Connect session for the run: the one this user's runs share, or a new one when the server
    closed it (idle too long) or the URL names a session of its own."""
    from pyspark.sql import SparkSession

    if "session_id=" in url:
        return SparkSession.builder.remote(url).create()
    cache = session_cache()
    spark = SparkSession.builder.remote(with_session(url, shared_session_id(url, cache))).create()
    try:
        spark.conf.get("spark.master")  # the server still has the session
    except Exception as exc:
        if "SESSION_CLOSED" not in str(exc) and "SESSION_CHANGED" not in str(exc):
            raise
        with contextlib.suppress(Exception):
            spark.client.close()
        spark = SparkSession.builder.remote(
            with_session(url, shared_session_id(url, cache, renew=True))
        ).create()
    return spark
