"""The ``mlflow`` connection: where the tracking server is, how to authenticate, and the check at
task start that it answers and accepts the credentials (before anything is submitted to Spark).

A connection of type ``mlflow``: ``host`` holds the tracking URI (``http://mlflow.internal:5000``;
a bare host name gets ``http://`` and the connection's ``port``), ``login``/``password`` basic
auth, extra ``token`` a bearer token, extra ``experiment_name`` the experiment (default: the DAG
id). MLflow's client reads credentials from the environment at each request
(``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN``): they are set in this task process only,
which follows one run, and kept from its children that run Spark (``keep_in_task``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig, TrackingUnavailable

CONN_TYPE = "mlflow"
#: What to install for tracking, in every message that asks for it.
INSTALL_HINT = 'pip install "airflow-provider-torchdist[mlflow]"'
#: MLflow's own HTTP retries (7, with backoff: minutes) would stall the start-of-task check and the
#: background logger's flushes; the logger retries on its own, so each request is tried once.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def require_mlflow(what: str) -> None:
    """Fail (at DAG parse time, from the operator) when the MLflow client is not installed."""
    if importlib.util.find_spec("mlflow") is None:
        raise InvalidTrainingConfig(
            f"{what} needs the MLflow client, which is not installed on this worker: {INSTALL_HINT} "
            "(it installs mlflow-skinny), or leave mlflow_conn_id unset."
        )


@dataclass(frozen=True)
class TrackingTarget:
    """A tracking server: its URI, the experiment to log in, and the credentials (never printed)."""

    uri: str
    experiment_name: str | None = None
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def auth_env(self) -> dict[str, str]:
        """The environment MLflow's client reads its credentials from."""
        env = {}
        if self.username:
            env["MLFLOW_TRACKING_USERNAME"] = self.username
            env["MLFLOW_TRACKING_PASSWORD"] = self.password or ""
        if self.token:
            env["MLFLOW_TRACKING_TOKEN"] = self.token
        return env


def tracking_uri(host: str | None, port: int | None, schema: str | None) -> str:
    """The tracking URI of a connection's fields: ``host`` as it is when it holds a scheme."""
    host = (host or "").strip()
    if not host:
        raise InvalidTrainingConfig(
            "The mlflow connection has no host: set it to the tracking URI, e.g. http://mlflow.internal:5000."
        )
    if "://" in host or host.startswith("databricks"):
        return host.rstrip("/") + (f":{port}" if port and host.count(":") < 2 else "")
    return f"{schema or 'http'}://{host}" + (f":{port}" if port else "")


def target_of(connection: Any) -> TrackingTarget:
    """The target described by an Airflow connection of type ``mlflow``."""
    extra = connection.extra_dejson or {}
    return TrackingTarget(
        uri=tracking_uri(connection.host, connection.port, connection.schema),
        experiment_name=extra.get("experiment_name") or None,
        username=connection.login or None,
        password=connection.password or None,
        token=extra.get("token") or None,
    )


def load_target(conn_id: str) -> TrackingTarget:
    """The target of the connection ``conn_id`` (Airflow's own lookup: secrets backends included)."""
    from airflow.providers.common.compat.sdk import BaseHook

    connection = BaseHook.get_connection(conn_id)
    if connection.conn_type not in (CONN_TYPE, None, ""):
        raise InvalidTrainingConfig(
            f"mlflow_conn_id={conn_id!r} is a {connection.conn_type!r} connection; it must be of type "
            f"{CONN_TYPE!r} (host: the tracking URI)."
        )
    return target_of(connection)


def connect(target: TrackingTarget) -> Any:
    """An ``MlflowClient`` for ``target``, checked: the server answers and takes the credentials.

    Raises :class:`~airflow_provider_torchdist.errors.TrackingUnavailable` saying which, so that the
    task fails before spark-submit rather than train unlogged."""
    require_mlflow("mlflow_conn_id")
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    auth = target.auth_env()
    from airflow_provider_torchdist.submit.spark_submit import keep_in_task

    # Only this process's clients read them: never the supervisor, spark-submit or the ranks.
    keep_in_task(name for name, value in auth.items() if os.environ.get(name) != value)
    os.environ.update(auth)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=target.uri, registry_uri=target.uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as exc:
        raise TrackingUnavailable(_why(target.uri, exc)) from exc
    return client


def _why(uri: str, exc: Exception) -> str:
    text = str(exc)
    if any(code in text for code in ("401", "403", "Unauthorized", "Forbidden", "PERMISSION_DENIED")):
        return (
            f"The MLflow tracking server at {uri} refused the credentials of the mlflow connection "
            f"({text[:300]}): check its login/password or extra token."
        )
    return (
        f"The MLflow tracking server at {uri} did not answer ({type(exc).__name__}: {text[:300]}): check "
        "the connection's host (the tracking URI) and that the server is up; nothing was submitted."
    )
