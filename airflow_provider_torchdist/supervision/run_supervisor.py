"""``RunSupervisor``: the supervisor of one run, without the process around it.

It listens for owners on the lifeline, runs spark-submit and follows the driver, keeps the run's
state for its owners, and tears it all down. Its rules for owners are in
:class:`~airflow_provider_torchdist.supervision.owners.OwnerRules`; what it runs, and how it reads
the verdict, in :mod:`~airflow_provider_torchdist.supervision.submission`. The process that holds it is
:mod:`~airflow_provider_torchdist.supervision.supervisor` (whose docstring tells the whole life of a run).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.driver.owner import read_channel_address
from airflow_provider_torchdist.spark.wire.private_files import write_private_text
from airflow_provider_torchdist.spark.wire.stop_request import stop_declined, write_stop_request
from airflow_provider_torchdist.supervision.config import EXIT_OK, SupervisorConfig, log, read_plan_text
from airflow_provider_torchdist.supervision.lifeline import (
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    LifelineServer,
    RunState,
)
from airflow_provider_torchdist.supervision.lifeline.address import lifeline_bind, where
from airflow_provider_torchdist.supervision.lock import ENDING_WAIT_S, RunLock
from airflow_provider_torchdist.supervision.owners import OwnerRules
from airflow_provider_torchdist.supervision.submission import (
    RunProcess,
    end_process,
    failure_summary,
    outcome_is_out,
    run_verdict,
    submission_of,
    verdict_when_out,
)
from airflow_provider_torchdist.supervision.sweep import ADDRESS_FILE, process_start_ticks

#: How often a stopping supervisor looks whether the ranks declined the grace period.
STOP_POLL_S = 0.1
#: How often the supervisor looks for the driver's outcome while spark-submit runs.
OUTCOME_POLL_S = 0.05
#: How long teardown lets a Spark application whose outcome is out stop by itself before it is killed.
STOPPING_AFTER_OUTCOME_S = 30.0


class RunSupervisor(OwnerRules):
    """The supervisor of one run (see :mod:`~airflow_provider_torchdist.supervision.supervisor`), without the
    process around it.

    ``make_run`` makes what runs (default: the plan's :class:`Submission`); ``follow=False`` skips
    following the driver (a test feeds ``state`` itself). Example::

        supervisor = RunSupervisor(staging, config, make_run=lambda: FakeRun())
        supervisor.listen()          # binds, writes supervisor.addr
        code = supervisor.serve()    # runs it, owns it, tears it down; returns the exit code
    """

    def __init__(
        self,
        staging_dir: Path,
        config: SupervisorConfig,
        *,
        plan_text: str | None = None,
        lock: RunLock | None = None,
        make_run: Callable[[], RunProcess] | None = None,
        follow: bool = True,
        silence_s: float = OWNER_SILENCE_S,
        ping_interval: float = PING_INTERVAL_S,
    ) -> None:
        super().__init__(config, RunState(), silence_s)
        self.staging_dir = staging_dir
        self.server: LifelineServer | None = None
        self.process: RunProcess | None = None
        self._lock_file = lock
        if make_run is None:
            text = plan_text if plan_text is not None else read_plan_text(staging_dir)
            make_run = lambda: submission_of(staging_dir, text, self.state.add_line)  # noqa: E731
        self._make_run = make_run
        self._follow = follow
        self._follower: Any = None
        self._ping_interval = ping_interval
        self._tearing_down = False
        self._outcome_out = False
        self._run_thread = threading.Thread(target=self._run, name="torchdist-run", daemon=True)

    # -- start

    def listen(self) -> tuple[str, int]:
        """Bind the lifeline and publish its address (``supervisor.addr``); owners may connect now."""
        config = self.config
        bind, fallback = lifeline_bind(config.bind_host, self.staging_dir)
        if fallback:
            log(fallback)
        self.server = LifelineServer(
            config.run_id,
            config.owner_secret,
            bind,
            self.state,
            self,
            silence_s=self._silence_s,
            ping_interval=self._ping_interval,
            status_secret=config.status_secret,
        )
        host, port = self.server.address
        if host in ("0.0.0.0", "::"):  # listening everywhere: owners need a name for this machine
            host = socket.getfqdn()
        write_private_text(
            self.staging_dir / ADDRESS_FILE,
            json.dumps(
                {"host": host, "port": port, "pid": os.getpid(), "start_ticks": process_start_ticks()}
            ),
        )
        with self._cond:
            self._wait_for_owner(self._first_owner_wait())
        self.server.start()
        log(f"run {config.run_id}: the lifeline listens on {where(host, port)}")
        return host, port

    def serve(self) -> int:
        """Run spark-submit and own the run until it is torn down; returns the exit code (0)."""
        if self.server is None:
            self.listen()
        self._run_thread.start()
        self.teardown(self._await_reason())
        return EXIT_OK

    # -- the run

    def _run(self) -> None:
        try:
            self._submit_and_conclude()
        except Exception as exc:  # anything unforeseen still ends the run, never leaves it hanging
            self._finish("failed", error=f"The run's supervisor failed while it ran the run: {exc!r}")

    def _submit_and_conclude(self) -> None:
        submit_error: BaseException | None = None
        try:
            if self._follow:
                self._start_follower()
            try:
                process = self._make_run()
            except Exception as exc:
                log(f"cannot start spark-submit: {exc!r}")
                self._finish("failed", error=f"The run's supervisor could not start spark-submit: {exc}")
                return
            with self._cond:
                if self._tearing_down:
                    return
                self.process = process
            self.state.set_running()
            log("spark-submit starts")
            threading.Thread(target=self._watch_outcome, name="torchdist-outcome", daemon=True).start()
            try:
                process.run()
            except Exception as exc:  # AirflowException: spark-submit failed
                submit_error = exc
            log(f"spark-submit ended{f': {submit_error}' if submit_error else ''}")
        finally:
            if self._follower is not None:
                self._follower.stop()
        self._conclude(submit_error)

    def _start_follower(self) -> None:
        from airflow_provider_torchdist.spark.driver.owner import write_owner_token
        from airflow_provider_torchdist.submit.follow import RunFollower

        self._follower = RunFollower(
            self.staging_dir,
            write_owner_token(self.staging_dir),
            on_line=self.state.add_line,
            on_application=self.state.set_application,
            on_metric=self.state.add_metric,
        )
        self._follower.start()

    def _watch_outcome(self) -> None:
        """Hand a succeeded run over once the driver's outcome is out, while Spark stops: the owner
        gets it 0.5 s sooner (:func:`verdict_when_out`); the run is torn down only once
        spark-submit has ended by itself (:meth:`teardown`)."""
        while self._run_thread.is_alive() and not self.state.ended:
            if not outcome_is_out(self.staging_dir):
                self._run_thread.join(OUTCOME_POLL_S)
                continue
            # Out: a succeeded run's verdict now, any other at spark-submit's end (one look).
            verdict = verdict_when_out(self.staging_dir, self.config.output_file)
            if verdict is not None:
                if self._follower is not None:
                    # The driver closed its channel before it wrote the outcome: its last lines
                    # and metrics are in before the owner gets "done".
                    self._follower.stop()
                with self._cond:
                    if self._tearing_down:
                        return
                    self._outcome_out = True
                log("the driver's outcome is out; Spark stops")
                self._finish(verdict[0], **verdict[1])
            return

    def _conclude(self, submit_error: BaseException | None) -> None:
        """spark-submit has ended: the run's verdict, as ``hook.run()`` would give it."""
        with self._cond:
            if self._tearing_down:
                return  # the teardown ended it, and said why
        state, details = run_verdict(self.staging_dir, self.config.output_file, submit_error)
        self._finish(state, **details)

    def _finish(self, state: str, **details: Any) -> None:
        if self.state.finish(state, **details):
            status = self.state.status()
            summary = "; ".join(filter(None, [status.error, *(failure_summary(f) for f in status.failures)]))
            log(f"the run {state}{f': {summary}' if summary else ''}")
        with self._cond:
            if self._owner is None and self._deadline is None:
                self._wait_for_owner(self.config.reattach_timeout)
            self._cond.notify_all()

    # -- teardown

    def _stop_gracefully(self, grace: float) -> str:
        """Ask the driver to stop the ranks (``stop-request.json``: they get the stop signal and
        ``stop_requested()``) and give the run ``grace`` seconds to end by itself; the owner still
        following sees every line of it. What is left afterwards :func:`end_process` ends.
        Returns what the run's error adds: how the stop went."""
        why = self._stop_why or "torn down"
        if read_channel_address(self.staging_dir) is None:
            # No driver channel yet, so no rank: nothing could checkpoint in a grace period.
            return "; it had not started training, so it was ended without a grace period"
        write_stop_request(self.staging_dir, why, grace)
        self._say(f"stop requested ({why}): ranks have {grace:g} s to checkpoint")
        start = time.monotonic()
        deadline = start + grace
        while self._run_thread.is_alive() and time.monotonic() < deadline:
            if stop_declined(self.staging_dir):  # no rank watches for stops: nothing to wait for
                return "; no rank's code watches for stops, so it was ended without a grace period"
            self._run_thread.join(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
        if self._run_thread.is_alive():
            self._say(f"the ranks did not end within the {grace:g} s grace period: the run is killed")
            return f"; the ranks had {grace:g} s to checkpoint and were killed when it ran out"
        took = time.monotonic() - start
        self._say(f"the run ended {took:.1f} s after the stop request")
        return f"; the ranks ended {took:.1f} s after the stop request (grace period {grace:g} s)"

    def _say(self, text: str) -> None:
        """A line of the supervisor's own in the run's log (the task log of whoever follows)."""
        log(text)
        self.state.add_line(f"[torchdist] {text}")

    def teardown(self, reason: str | None = None) -> None:
        """End everything of the run and remove its traces; idempotent."""
        with self._cond:
            if self._tearing_down:
                return
            self._tearing_down = True
            self._request(reason or "torn down")
            reason, run_error = self._reason, self._run_error
            process = self.process
            self._cond.notify_all()
            stopping = STOPPING_AFTER_OUTCOME_S if self._outcome_out else 0.0
        log(f"tearing down: {reason}")
        running = process is not None and not self.state.ended and self._run_thread.is_alive()
        grace = self.config.stop_grace_period if running else 0.0
        if self._lock_file is not None:
            # The next run of this task may wait for the lock now, for as long as this stop can take.
            self._lock_file.mark_ending(time.time() + grace + stopping + ENDING_WAIT_S)
        if self.server is not None:
            self.server.stop_accepting()  # a new owner now finds nothing: the run is gone
        stopped = self._stop_gracefully(grace) if grace > 0 else ""
        if not self.state.ended:
            error = run_error or f"The run was torn down before it ended: {reason}"
            self.state.finish("failed", error=f"{error}{stopped}")
        if process is not None:
            # An application whose outcome is out is stopping by itself: not killed mid-stop
            # (a cluster would record it as killed), unless the stop hangs.
            self._run_thread.join(stopping)
            end_process(process, self._run_thread)
        if self._follower is not None:
            self._follower.stop()
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.release()
        if self.server is not None:  # last: an owner waiting for the close knows all of it is done
            self.server.close(f"run {self.run_id} was torn down: {reason}")
        log("torn down")
