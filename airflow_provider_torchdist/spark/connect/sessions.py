"""The Connect session a run uses: one of its own, named in the run's URL when the hook plans it
(:func:`run_session_url`), or the one the connection's URL names.

A session holds temp views, settings and Python workers: runs of different DAGs over one
connection must not share one. A session of the run's own costs its Python workers' start on the
server (about 1.5 s a run), and the driver releases it when the run ends, so the server does not
keep one per run until its idle timeout.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from airflow_provider_torchdist.spark.wire.connect_ids import canonical_uuid


def _params(url: str) -> list[str]:
    return [p for p in url.partition("/;")[2].split(";") if p]


def with_session(url: str, session_id: str) -> str:
    """``url`` naming ``session_id`` (in place of a session it named)."""
    base = url.partition("/;")[0].rstrip("/") if "/;" in url else url.rstrip("/")
    kept = [p for p in _params(url) if p.partition("=")[0] != "session_id"]
    return f"{base}/;{';'.join([*kept, f'session_id={session_id}'])}"


def planned_session_id(url: str) -> str | None:
    """The session a run's driver opens with ``url`` (:func:`run_session_url`'s), for the run's
    record, so that a retry can interrupt a lost run's job there; None when ``url`` names none, or
    one that is no UUID."""
    for param in _params(url):
        name, _, value = param.partition("=")
        if name == "session_id":
            return canonical_uuid(value)
    return None


def run_session_url(url: str) -> str:
    """The URL a run's driver opens: ``url`` with a fresh session of the run's own, unless
    ``url`` names a session itself (the user's choice, shared by whatever uses that connection)."""
    if any(p.partition("=")[0] == "session_id" for p in _params(url)):
        return url
    return with_session(url, str(uuid.uuid4()))


def open_session(url: str) -> Any:
    """The run's Connect session: the one ``url`` names (a fresh one when it names none)."""
    from pyspark.sql import SparkSession

    return SparkSession.builder.remote(run_session_url(url)).create()


def release_session(spark: Any) -> None:
    """Release the run's session on the server (its temp views, settings, Python workers), then
    close the client. Best effort: a server that is gone has released it already."""
    with contextlib.suppress(Exception):
        spark.client.release_session()
    with contextlib.suppress(Exception):
        spark.client.close()
