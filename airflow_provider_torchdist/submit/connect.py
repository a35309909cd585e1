"""Spark Connect as the engine of a run: the checks before it starts, and its "submission".

A ``spark_connect`` connection sends the run through Spark Connect: instead of ``spark-submit``
starting a Spark driver JVM here, a Python child process
(:mod:`~airflow_provider_torchdist.spark.connect.driver`) opens a Connect session and runs the
barrier stage on the server's cluster. :class:`ConnectSubmission` has :class:`.spark_submit.Submission`'s
interface (``run``, ``kill``, ``session``), so the hook's in-process path and the supervisor run it
unchanged, and the follower, the outcome file and the kill by session work as for spark-submit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from airflow.providers.common.compat.sdk import AirflowException

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed
from airflow_provider_torchdist.spark.connect.driver import CHANNEL_HOST_ENV, URL_ENV
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.parent_death import signal_on_parent_death
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import (
    CONNECT_CONN_TYPE,
    TRUSTED_NETWORK_EXTRA,
    SparkTarget,
)
from airflow_provider_torchdist.submit.plan import SubmitPlan
from airflow_provider_torchdist.submit.spark_submit import (
    CONNECT_CLIENT_ENV,
    Submission,
    spark_side_environment,
)
from airflow_provider_torchdist.submit.staging import SPARK_ZIP

log = logging.getLogger(__name__)

#: Seconds to wait for the Connect server's port before saying it cannot be reached.
CONNECT_TIMEOUT_S = 5.0


def check_connect_run(
    spec: TrainingSpec, target: SparkTarget, train_object: Any = None, timeout: float = CONNECT_TIMEOUT_S
) -> None:
    """Refuse what this engine does not do, then check that the server's port answers."""
    where = f"over the Spark Connect connection {spec.conn_id!r}"
    if spec.local_mode:
        raise InvalidTrainingConfig(
            f"local_mode=True cannot run {where}: the Connect server's driver runs no user code, and "
            "local mode trains on the Spark driver's machine. Use local_mode=False (the ranks run in "
            "the server's executors), or a 'spark' connection for local mode."
        )
    if spec.elastic and importlib.util.find_spec("torch") is None:
        raise InvalidTrainingConfig(
            f"an elastic num_processes={spec.num_processes!r} {where} serves its rendezvous store from this "
            "worker (torch's TCPStore, in the Connect client), and torch is not installed here: install "
            "torch on the worker, or train with a fixed num_processes, which needs no torch here."
        )
    # Spark settings belong to the server there: its executors, resources and Python are its own.
    if dropped := [name for name in ("conf", "spark_submit_kwargs") if getattr(spec, name)]:
        raise InvalidTrainingConfig(
            f"{' and '.join(dropped)} cannot apply {where}: the Spark application is the Connect server's. "
            "Set executor resources, GPUs and the executors' Python on the server, and leave these unset."
        )
    url = urlparse((target.connect_url or "").replace("sc://", "http://", 1))
    if not url.hostname or url.path not in ("", "/"):
        raise InvalidTrainingConfig(
            f"The Spark Connect connection {spec.conn_id!r} does not make a valid sc://host:port URL (a host is "
            "missing, or a parameter such as the token holds a '/', which the URL cannot carry): check its "
            "host, and use a token without '/'."
        )
    check_connect_transport(spec, target)
    try:
        with socket.create_connection((url.hostname or "", url.port or 15002), timeout=timeout):
            return
    except OSError as exc:
        raise SparkSubmitFailed(
            f"Cannot reach the Spark Connect server {target.master} ({exc.strerror or type(exc).__name__}), "
            f"so nothing was started. Check that the server is running and that the connection "
            f"{spec.conn_id!r} names its host and port (sc://host:15002), reachable from this worker."
        ) from None


def connect_is_private(url: str) -> bool:
    """Does pyspark's client keep the job's plan private on its way to the server at ``url``
    (``sc://host:port/;params``)? It does with TLS (``use_ssl=true``, or a ``token``, which pyspark
    sends over TLS, or to ``localhost`` over gRPC's local credentials, loopback only), and over
    loopback, where no network carries it."""
    parsed = urlparse(url.replace("sc://", "http://", 1))
    params = dict(p.partition("=")[::2] for p in url.partition("/;")[2].split(";") if p)
    if params.get("use_ssl", "").lower() == "true" or params.get("token"):
        return True
    host = parsed.hostname or ""
    with contextlib.suppress(ValueError):
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    return False


def check_connect_transport(spec: TrainingSpec, target: SparkTarget) -> None:
    """Refuse, before anything starts, an elastic run over a Connect channel without TLS to a server
    off this machine, unless the connection says its network is trusted.

    Over Connect every node's claim secret and the run's token travel inside the job's plan: who
    reads the plan on the way can claim an elastic run's nodes (a fixed-size run stops at a second
    claim of a node; an elastic one must take lost nodes back)."""
    if not spec.elastic or target.connection.get("trusted_network"):
        return
    if connect_is_private(target.connect_url or ""):
        return
    raise InvalidTrainingConfig(
        f"an elastic num_processes={spec.num_processes!r} over the Spark Connect connection {spec.conn_id!r} "
        f"({target.master}) would send its nodes' claim credentials, inside the job's plan, unencrypted: "
        "turn on TLS (the connection's extra use_ssl: true, with a server that serves TLS), or, where "
        f"the network between this worker and the server is trusted, set the connection's extra "
        f'"{TRUSTED_NETWORK_EXTRA}": true. A fixed num_processes needs neither.'
    )


#: How long a retry waits for the server to interrupt a lost run's job (pyspark would retry an
#: unreachable server for minutes).
INTERRUPT_TIMEOUT_S = 20.0


def interrupt_lost_run(
    url: str, session_id: str, run_id: str, timeout: float = INTERRUPT_TIMEOUT_S, remote: Any = None
) -> list[str]:
    """Interrupt, on the Connect server at ``url``, the job of run ``run_id`` whose driver is gone
    (its supervisor lost with its machine, or SIGKILLed), in the session ``session_id`` its record
    holds; returns the ids of the operations interrupted (none: it had ended, or the server closed
    the session and its jobs with it). Raises ``TimeoutError`` when the server does not answer
    within ``timeout`` seconds. ``remote``: what makes the session (default ``SparkSession.builder.remote``).

    It interrupts by the run's tag (:func:`~airflow_provider_torchdist.spark.connect.driver.job_tag`), which the record's
    operation id may not be known for yet (a job still waiting for its slots has not reported).

    A driver that dies leaves its job to the server: the nodes end their ranks when they notice
    (the run channel closes), and the server ends a job nobody reattaches to after its
    ``spark.connect.execute.manager.detachedTimeout``; until then, a job still waiting for its task
    slots, or whose nodes cannot tell the driver is gone (a frozen machine), would hold the cluster.
    """
    from airflow_provider_torchdist.spark.connect.driver import job_tag
    from airflow_provider_torchdist.spark.connect.sessions import with_session

    if remote is None:
        from pyspark.sql import SparkSession

        remote = SparkSession.builder.remote
    answer: list[Any] = []

    def interrupt() -> None:
        # A Connect session marks its process as a Connect client (SPARK_CONNECT_MODE_ENABLED):
        # this is the task's process, which must not stay marked for what it runs next.
        marks = {key: os.environ.get(key) for key in CONNECT_CLIENT_ENV}
        try:
            spark = remote(with_session(url, session_id)).create()
        except Exception as exc:
            answer.append(exc)
            return
        finally:
            for key, value in marks.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            answer.append(list(spark.interruptTag(job_tag(run_id))))
        except Exception as exc:
            closed = "SESSION_CLOSED" in str(exc) or "SESSION_CHANGED" in str(exc)
            answer.append([] if closed else exc)  # a closed session's jobs ended with it
        finally:
            _leave_session(spark, url, session_id)

    worker = threading.Thread(target=interrupt, daemon=True, name="torchdist-interrupt-lost-run")
    worker.start()
    worker.join(timeout)
    if not answer:
        raise TimeoutError(f"the Spark Connect server did not answer within {timeout:.0f} s")
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return answer[0]


def _leave_session(spark: Any, url: str, session_id: str) -> None:
    """After the interrupt: release the lost run's own session (nothing else would before the
    server's idle timeout); only close the client in a session the connection names (the user's)."""
    from airflow_provider_torchdist.spark.connect.sessions import planned_session_id, release_session

    if planned_session_id(url) == session_id:
        with contextlib.suppress(Exception):
            spark.client.close()
    else:
        release_session(spark)


def submission_for(plan: SubmitPlan) -> Submission | ConnectSubmission:
    """The submission that runs ``plan``: spark-submit, or the Connect driver for a Connect target."""
    if plan.connection.get("conn_type") == CONNECT_CONN_TYPE:
        return ConnectSubmission(plan)
    return Submission(plan)


class ConnectSubmission:
    """The Connect driver as a child in a session of its own (its PID), run to its end.

    The plan's ``application_args`` hold the staged spec; the URL (which may carry a token) is
    the plan's ``connection["url"]``, passed in the child's environment, never on its command line.
    """

    def __init__(self, plan: SubmitPlan) -> None:
        self.plan = plan
        self.session: int | None = None
        self._proc: subprocess.Popen[str] | None = None

    def run(self) -> None:
        """The Connect driver to its end; raises ``AirflowException`` when it fails."""
        env = {
            **spark_side_environment(os.environ),
            **self.plan.env,
            URL_ENV: self.plan.connection["url"],
        }
        if self.plan.connection.get("channel_host"):
            env[CHANNEL_HOST_ENV] = self.plan.connection["channel_host"]
        # The user's py_files (not this provider's own zip: the server's executors have it
        # installed) go with the job, read by the driver.
        user_py_files = [p for p in self.plan.py_files if Path(p).name != SPARK_ZIP]
        command = [
            sys.executable,
            "-m",
            "airflow_provider_torchdist.spark.connect.driver",
            *self.plan.application_args,
            *user_py_files,
        ]
        emit("spark_submit_start")
        try:
            self._proc = subprocess.Popen(
                command,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                # The driver goes when this thread's process dies (a SIGKILLed supervisor too): on
                # the SIGTERM it interrupts its job, so nothing trains on for nobody.
                preexec_fn=signal_on_parent_death(signal.SIGTERM),
            )
            self.session = self._proc.pid
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                log.info("%s", line.rstrip("\n"))
            code = self._proc.wait()
        finally:
            emit("spark_submit_end")
        if code != 0:
            raise AirflowException(f"The Spark Connect driver exited with code {code}")

    def kill(self) -> None:
        """End the driver: on SIGTERM it interrupts its Connect job (``interruptTag``), then exits."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
