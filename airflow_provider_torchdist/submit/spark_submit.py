"""The spark-submit engine: a :class:`~airflow_provider_torchdist.submit.plan.SubmitPlan` run the
way ``SparkSubmitOperator`` runs one: the Spark provider's public constructor, then ``submit()``,
then ``on_kill()`` when asked (Spark Connect's engine is :mod:`~airflow_provider_torchdist.submit.connect`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
from collections.abc import Iterable, Mapping

import psutil
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.parent_death import signal_on_parent_death
from airflow_provider_torchdist.submit.connection import connection_in_environment
from airflow_provider_torchdist.submit.jvm import install_pending_archive
from airflow_provider_torchdist.submit.plan import SubmitPlan
from airflow_provider_torchdist.submit.properties import write_private_properties

#: What makes PySpark a Spark Connect client (``SparkSession.builder.remote`` sets the first in its
#: own process): spark-submit's driver given one of these refuses to make a SparkContext.
CONNECT_CLIENT_ENV = frozenset({"SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE"})

#: The variables set in this (the task's) process for its own clients only, comma-separated: the
#: MLflow credentials of ``mlflow_conn_id``. No child that runs Spark inherits them (a supervisor,
#: spark-submit, so neither its driver nor local ranks): see :func:`spark_side_environment`.
TASK_ONLY_ENV = "TORCHDIST_TASK_ONLY_ENV"


def keep_in_task(names: Iterable[str]) -> None:
    """Mark ``names`` (set in ``os.environ`` for this process's own clients) as never for Spark."""
    kept = set(filter(None, os.environ.get(TASK_ONLY_ENV, "").split(","))) | set(names)
    os.environ[TASK_ONLY_ENV] = ",".join(sorted(kept))


def spark_side_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less what :func:`keep_in_task` kept in the task's process (and its list)."""
    dropped = {TASK_ONLY_ENV, *environ.get(TASK_ONLY_ENV, "").split(",")}
    return {key: value for key, value in environ.items() if key not in dropped}


SUBMISSION_MARKER = "TORCHDIST_SUBMISSION"
"""The environment variable that tells one :class:`Submission`'s spark-submit from another's."""


class Submission:
    """One plan run through ``SparkSubmitHook``'s public API; :meth:`kill` stops it from another thread.

    ``session`` is spark-submit's session id (its PID: it starts a session of its own), noted as
    soon as it starts, so that whatever the run leaves in that session can be ended by PID later.
    """

    def __init__(self, plan: SubmitPlan) -> None:
        self.plan = plan
        self.session: int | None = None
        self._hook: SparkSubmitHook | None = None
        self._done = threading.Event()

    def make_hook(self) -> SparkSubmitHook:
        """The Spark provider's hook for this plan; the connection resolves from the plan itself."""
        plan = self.plan
        write_private_properties(plan.properties_file, plan.properties)
        with connection_in_environment(plan.connection) as conn_id:
            return SparkSubmitHook(
                conn_id=conn_id,
                properties_file=plan.properties_file,
                files=",".join(plan.files) or None,
                py_files=",".join(plan.py_files) or None,
                application_args=plan.application_args,
                **plan.submit_kwargs,
            )

    def run(self) -> None:
        """spark-submit to its end; raises ``AirflowException`` when it fails.

        It runs in a session of its own, so a kill reaches the driver and every local rank too, and
        inherits no descriptor of this process: stdin is /dev/null.
        """
        self._hook = self.make_hook()
        # Several runs may start spark-submit at once from one process (threads, a test, a
        # supervisor): the child is told apart from theirs by a marker only its environment holds.
        marker = secrets.token_hex(16)
        watcher = threading.Thread(target=self._note_session, args=(marker,), daemon=True)
        watcher.start()
        try:
            emit("spark_submit_start")
            # The environment goes to Popen (submit's keywords), not as env_vars: on YARN and
            # Kubernetes the provider would also turn env_vars into --conf pairs on the command line.
            env = {
                key: value
                for key, value in {
                    **spark_side_environment(os.environ),
                    **self.plan.env,
                    SUBMISSION_MARKER: marker,
                }.items()
                if key not in CONNECT_CLIENT_ENV
            }
            self._hook.submit(
                self.plan.application,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                env=env,
                # spark-submit goes when this thread's process dies (a SIGKILLed supervisor too):
                # the kernel signals it, whatever became of this PID (its driver follows it).
                preexec_fn=signal_on_parent_death(signal.SIGTERM),
            )
        finally:
            emit("spark_submit_end")
            self._done.set()
            watcher.join()
            # Here, not in the run's owner: a supervised run's owner may be gone by now (its
            # verdict came with the driver's outcome, before the JVM wrote the archive at exit).
            install_pending_archive(self.plan.jvm_archive)

    def _note_session(self, marker: str) -> None:
        """Find the child that spark-submit's ``Popen`` made: the one leading its own session whose
        environment carries ``marker`` (until it execs, a forked child still shows ours)."""
        me = psutil.Process()
        while self.session is None:
            for child in me.children():
                with contextlib.suppress(psutil.Error, OSError):
                    if os.getsid(child.pid) == child.pid and child.environ().get(SUBMISSION_MARKER) == marker:
                        self.session = child.pid
                        return
            if self._done.wait(0.005):
                return

    def kill(self) -> None:
        """``SparkSubmitHook.on_kill``: ends spark-submit (and a cluster-side application)."""
        if self._hook is not None:
            self._hook.on_kill()
