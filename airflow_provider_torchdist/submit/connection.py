"""Where a run goes: the Spark connection resolved once, in the task, into a plain ``SparkTarget``.

- A ``spark`` connection is used as the Spark provider reads it.
- A ``torchdist_spark`` connection (this provider's form, with ``master-web-ui``) is read as the
  ``spark`` connection it mirrors: the Spark provider builds master URLs for ``spark`` only.
- No connection under the default id ``spark_default`` means the embedded master: ``local[N]`` on
  this machine, its servers on 127.0.0.1.

The target carries the connection itself as plain data (``connection``, Airflow's JSON form), so
another process (the run's supervisor) can hand it to ``SparkSubmitHook`` without the Task SDK:
:func:`connection_in_environment` exposes it under a connection id of its own, through Airflow's
environment-variable secrets backend, for as long as the hook resolves it.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from airflow.providers.common.compat.sdk import AirflowNotFoundException, BaseHook

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.data.data_shards import SHARED_DIR_CONF
from airflow_provider_torchdist.spec import DEFAULT_CONN_ID, TrainingSpec

#: This provider's connection type: a ``spark`` connection whose form also shows ``master-web-ui``.
CONN_TYPE = "torchdist_spark"
#: Connection extra with the standalone master's web UI, e.g. ``http://spark-master:8080``: with it the
#: hook checks before submitting that the cluster can ever fit the job.
MASTER_WEB_UI_EXTRA = "master-web-ui"
#: Connection extra with the Spark history server, e.g. ``http://spark-history:18080``: the task then
#: links to the run's page there, which outlives the driver's own UI.
HISTORY_SERVER_EXTRA = "history-server-url"
#: The Spark provider's Spark Connect connection type (``SparkConnectHook``).
CONNECT_CONN_TYPE = "spark_connect"
#: Connection extra of a ``spark_connect`` connection: the address of the Airflow worker that the
#: server's executors reach (default: this machine's address on the route to the server's driver).
CHANNEL_HOST_EXTRA = "channel-host"
#: Connection extra of a ``spark_connect`` connection: ``true`` says the network between this
#: worker and the server is trusted, so an elastic run may go over it without TLS (see
#: :func:`~airflow_provider_torchdist.submit.connect.check_connect_transport`).
TRUSTED_NETWORK_EXTRA = "trusted-network"
#: Connection extra: a directory that the driver and every node of the cluster mount at this path
#: (NFS, Lustre, ...), writable by the executors' user. ``train_data``'s rows then go through it, as
#: files, instead of through Spark's shuffle (``spark.torchdist.trainData.sharedDir``; a run's
#: ``conf`` may set that itself).
SHARED_DIR_EXTRA = "shared-dir"
EMBEDDED_HOST = "127.0.0.1"
DEFAULT_SPARK_BINARY = "spark-submit"


@dataclass(frozen=True)
class SparkTarget:
    """A resolved Spark connection: the master, and the connection ``SparkSubmitHook`` reads it from."""

    master: str
    #: Airflow's JSON form of the connection (``conn_type`` always ``spark``).
    connection: dict[str, Any]
    embedded: bool = False
    deploy_mode: str | None = None
    master_web_ui: str | None = None
    history_server: str | None = None
    spark_binary: str = DEFAULT_SPARK_BINARY
    #: Spark settings the target needs (the embedded master keeps its servers on loopback).
    conf: dict[str, str] = field(default_factory=dict)
    #: A ``spark_connect`` connection's URL (``sc://host:port/;token=...``): the run goes through
    #: Spark Connect instead of spark-submit (:mod:`~airflow_provider_torchdist.spark.connect.driver`).
    connect_url: str | None = None

    @property
    def is_connect(self) -> bool:
        return self.connect_url is not None

    @property
    def is_yarn(self) -> bool:
        return "yarn" in self.master

    @property
    def is_kubernetes(self) -> bool:
        return "k8s" in self.master

    @property
    def is_local(self) -> bool:
        return self.master.startswith("local")


def master_url(conn_type: str, host: str | None, port: int | None) -> str:
    """The master URL the Spark provider makes of a ``spark`` connection (``spark://h:7077``,
    ``yarn``, ``k8s://https://h``, ``local[4]``). ``tests/unit`` checks it against the provider's."""
    if conn_type == "spark" and host and ("://" in host or not port):
        master = host
    else:
        master = f"{conn_type}://{host or ''}"
    return f"{master}:{port}" if port else master


def resolve_target(spec: TrainingSpec, log: Any = None) -> SparkTarget:
    """The target of ``spec``'s connection; the embedded master when ``spark_default`` is undefined."""
    try:
        conn = BaseHook.get_connection(spec.conn_id)
    except AirflowNotFoundException:
        if spec.conn_id != DEFAULT_CONN_ID:
            raise InvalidTrainingConfig(
                f"Spark connection {spec.conn_id!r} is not defined. Create it (Admin > Connections, or "
                f"AIRFLOW_CONN_{spec.conn_id.upper()}='spark://host:7077'), or leave conn_id unset to run "
                "on the embedded local Spark master."
            ) from None
        return embedded_target(spec, log)
    if conn.conn_type == CONNECT_CONN_TYPE:
        return connect_target(spec.conn_id)
    conn_type = "spark" if conn.conn_type == CONN_TYPE else conn.conn_type
    extra = conn.extra_dejson
    data = {
        "conn_type": "spark",
        "host": conn.host,
        "port": conn.port,
        "login": conn.login,
        "password": conn.password,
        "schema": conn.schema,
        "extra": extra,
    }
    if conn_type != "spark":  # a URI connection: the provider rebuilds scheme://host from conn_type
        data["host"] = master_url(conn_type, conn.host, None)
    master = master_url(conn_type, conn.host, conn.port)
    deploy_mode = spec.spark_submit_kwargs.get("deploy_mode") or extra.get("deploy-mode")
    shared_dir = extra.get(SHARED_DIR_EXTRA)
    if shared_dir is not None and not (isinstance(shared_dir, str) and os.path.isabs(shared_dir)):
        raise InvalidTrainingConfig(
            f"Spark connection {spec.conn_id!r}: the extra {SHARED_DIR_EXTRA!r} must be the absolute path "
            f"of a directory that the driver and every node mount, got {shared_dir!r}."
        )
    return SparkTarget(
        master=master,
        connection={k: v for k, v in data.items() if v not in (None, "", {})},
        deploy_mode=deploy_mode,
        master_web_ui=extra.get(MASTER_WEB_UI_EXTRA),
        history_server=extra.get(HISTORY_SERVER_EXTRA),
        spark_binary=spec.spark_submit_kwargs.get("spark_binary")
        or extra.get("spark-binary")
        or DEFAULT_SPARK_BINARY,
        conf={SHARED_DIR_CONF: shared_dir} if shared_dir else {},
    )


def connect_target(conn_id: str) -> SparkTarget:
    """A ``spark_connect`` connection: its URL as the Spark provider's ``SparkConnectHook`` makes
    it (token and ``use_ssl`` included)."""
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

    hook = SparkConnectHook(conn_id=conn_id)
    url = hook.get_connection_url()
    extra = hook.get_connection(conn_id).extra_dejson
    trusted = str(extra.get(TRUSTED_NETWORK_EXTRA, "")).strip().lower() in ("true", "1", "yes")
    return SparkTarget(
        master=url.split("/;", 1)[0],  # without the token: what the log and the checks may show
        connection={
            "conn_type": CONNECT_CONN_TYPE,
            "url": url,
            "channel_host": extra.get(CHANNEL_HOST_EXTRA),
            "trusted_network": trusted,
        },
        connect_url=url,
    )


def embedded_target(spec: TrainingSpec, log: Any = None) -> SparkTarget:
    """``local[N]`` on this machine: N slots for the stage's tasks (1 in local mode); an elastic
    run's N is its MAX, so every node it may take in finds a slot."""
    master = f"local[{1 if spec.local_mode else spec.max_processes}]"
    if log is not None:
        log.info(
            "No Spark connection %r is configured: running on an embedded local Spark master %s on %s. "
            "Create a 'spark' connection to use a cluster.",
            spec.conn_id,
            master,
            EMBEDDED_HOST,
        )
    return SparkTarget(
        master=master,
        connection={"conn_type": "spark", "host": master},
        embedded=True,
        spark_binary=spec.spark_submit_kwargs.get("spark_binary") or DEFAULT_SPARK_BINARY,
        # Keep the driver's servers (RPC, block manager, UI) on loopback.
        conf={"spark.driver.host": EMBEDDED_HOST, "spark.driver.bindAddress": EMBEDDED_HOST},
    )


@contextmanager
def connection_in_environment(connection: dict[str, Any]) -> Iterator[str]:
    """A connection id under which ``connection`` resolves while the block runs (Airflow reads
    ``AIRFLOW_CONN_<ID>`` before any other secrets backend); removed afterwards, so nothing started
    later inherits it."""
    conn_id = f"torchdist_run_{secrets.token_hex(8)}"
    name = f"AIRFLOW_CONN_{conn_id.upper()}"
    os.environ[name] = json.dumps(connection)
    try:
        yield conn_id
    finally:
        os.environ.pop(name, None)
