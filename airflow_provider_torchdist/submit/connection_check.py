"""Is the Spark connection a run would use there, and does its master answer? (for ``doctor``)

The connection is resolved exactly as a run resolves it (:func:`~.connection.resolve_target`), so
``doctor`` says what a task on this worker would get: the embedded ``local[N]`` master when the
default ``spark_default`` is undefined, else the connection's master. A standalone master
(``spark://host:port``) is asked, with a short timeout, whether its port takes connections and
whether its web UI answers (the ``master-web-ui`` extra, else the master's default UI port), and the
UI's alive workers and cores are shown; a Spark Connect server's port is tried the same way. YARN and
Kubernetes masters are named, not asked.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from airflow_provider_torchdist.spec import DEFAULT_CONN_ID, TrainingSpec
from airflow_provider_torchdist.submit.connection import MASTER_WEB_UI_EXTRA, SparkTarget, resolve_target

#: How long doctor waits for a master's port or web UI: enough for a LAN, short for a person waiting.
TIMEOUT_S = 3.0
#: Where a standalone master serves its web UI unless told otherwise (``spark.master.ui.port``).
DEFAULT_MASTER_UI_PORT = 8080


def _port_answers(host: str, port: int) -> str | None:
    """None when ``host:port`` takes a TCP connection within :data:`TIMEOUT_S`, else why not."""
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _web_ui_state(url: str) -> tuple[dict | None, str]:
    """The standalone master's ``/json/`` state, or None and why not."""
    import requests

    try:
        answer = requests.get(url.rstrip("/") + "/json/", timeout=TIMEOUT_S)
        answer.raise_for_status()
        return answer.json(), ""
    except (requests.RequestException, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _standalone(conn_id: str, target: SparkTarget) -> tuple[bool, str]:
    address = urlsplit(target.master.split(",")[0])  # spark://h:7077 (an HA list: its first master)
    host, port = address.hostname or "", address.port or 7077
    head = f"{conn_id!r}: standalone master {target.master}"
    refused = _port_answers(host, port)
    if refused:
        return False, (
            f"{head} does not answer on {host}:{port} ({refused}): start the master, or fix the "
            f"connection's host and port."
        )
    ui = target.master_web_ui or f"http://{host}:{DEFAULT_MASTER_UI_PORT}"
    state, why = _web_ui_state(ui)
    if state is None:
        if target.master_web_ui:
            return False, (
                f"{head} answers, but its web UI {ui} (the {MASTER_WEB_UI_EXTRA!r} extra) does not ({why}): "
                "runs check the cluster's slots there before submitting. Fix the extra's URL."
            )
        return True, (
            f"{head} answers; no {MASTER_WEB_UI_EXTRA!r} extra and nothing at {ui}: set the extra to the "
            "master's web UI so runs check the cluster's slots before submitting."
        )
    workers = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
    cores = sum(int(w.get("cores", 0)) for w in workers)
    free = sum(int(w.get("coresfree", 0)) for w in workers)
    summary = (
        f"{head} answers; web UI {ui}: {state.get('status', '?')}, {len(workers)} alive worker(s), "
        f"{cores} core(s), {free} free"
    )
    if not workers:
        return False, f"{summary}: no worker has registered, so no run can start. Start a worker."
    return True, summary


def check_spark_connection(conn_id: str = DEFAULT_CONN_ID) -> tuple[bool, str]:
    """Whether ``conn_id`` (the operator's default: ``spark_default``) is ready, and what it is."""
    try:
        target = resolve_target(TrainingSpec(conn_id=conn_id))
    except Exception as exc:  # an undefined non-default id, a bad extra: the run's own error
        return False, str(exc)
    if target.embedded:
        return True, (
            f"{conn_id!r} is not defined: runs use the embedded local master (local[N], N = the run's "
            "num_processes; 1 in local mode) on this machine. Create a 'spark' connection of that id to "
            "use a cluster."
        )
    if target.is_connect:
        address = urlsplit(target.master)
        host, port = address.hostname or "", address.port or 15002
        refused = _port_answers(host, port)
        where = f"{conn_id!r}: Spark Connect server {target.master}"
        return (False, f"{where} does not answer ({refused}).") if refused else (True, f"{where} answers.")
    if target.master.startswith("spark://"):
        return _standalone(conn_id, target)
    if target.is_local:
        return True, f"{conn_id!r}: {target.master}, a local master on this machine."
    return True, f"{conn_id!r}: master {target.master} (not asked: doctor checks standalone masters only)."
