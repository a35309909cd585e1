"""The hook's supervised runs, the operator's path: a run handed to a detached supervisor, owned
over its lifeline, left on purpose, taken over, stopped.

:class:`SupervisedRunsMixin` is the half of
:class:`~airflow_provider_torchdist.hooks.torch_distributor.TorchDistributorHook` that owns a run
apart from this process; the hook gives it the staged, planned run (``_prepare``), its target and
the callbacks the operator set (``on_application``, ``on_operation``, ``on_metrics``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from airflow.providers.common.compat.sdk import AirflowTaskTimeout

from airflow_provider_torchdist.errors import SparkSubmitFailed
from airflow_provider_torchdist.spark.connect.sessions import planned_session_id
from airflow_provider_torchdist.spark.driver.stragglers import split_summaries
from airflow_provider_torchdist.spec import DEFAULT_REATTACH_TIMEOUT
from airflow_provider_torchdist.submit.connect import interrupt_lost_run
from airflow_provider_torchdist.supervision.lifeline import LifelineError, OwnerConnection, RunStatus
from airflow_provider_torchdist.supervision.record import RunRecord, TaskBinding
from airflow_provider_torchdist.supervision.task_side import (
    connect_owner,
    end_run,
    follow_to_end,
    lifeline_host,
    raise_for_failure,
    start_supervisor,
)

T = TypeVar("T")
#: How long ``follow(wait_for_teardown=True)`` waits: Spark's stop (killed after 30 s), then the rest.
TEARDOWN_WAIT_S = 40.0


class SupervisedRunsMixin:
    """Start, own, leave, take over and stop supervised runs (see the module docstring)."""

    _owner: OwnerConnection | None
    record: RunRecord | None
    run_status: RunStatus | None
    metrics: list[dict[str, Any]]
    rank_step_times: list[dict[str, Any]]
    world_sizes: list[dict[str, Any]]
    on_metrics: Callable[[list[dict[str, Any]]], None] | None

    def start_run(
        self,
        train_object: Callable[..., Any] | str,
        args: list[Any] | tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        durable: bool = True,
        reattach_timeout: float = DEFAULT_REATTACH_TIMEOUT,
        task: TaskBinding | None = None,
    ) -> RunRecord:
        """Stage and plan the run, and hand it to a detached supervisor; returns the run's record.

        The run no longer lives and dies with this process: :meth:`follow` owns it (this hook is
        connected as its owner already), and a retry or a trigger can own it later from the
        record. Without an owner, a ``durable=False`` run ends within 15 s; a durable one waits
        ``reattach_timeout`` seconds for the next (see :mod:`~airflow_provider_torchdist.supervision.task_side`).
        ``task``: the task instance the run belongs to (the operator's); only its owners can own it.
        """
        staged = self._prepare(train_object, args, kwargs)
        assert self.plan is not None
        record = start_supervisor(
            staged,
            self.plan,
            durable=durable,
            reattach_timeout=reattach_timeout,
            bind_host=lifeline_host(),
            checkpoint_dir=self.spec.checkpoint_dir,
            task=task,
        )
        self.staged = None  # the supervisor's now: it removes it when the run ends
        if self.target.is_connect and (session_id := planned_session_id(self.plan.connection["url"])):
            record = record.with_session(session_id)  # where its job goes: a lost run's is interrupted there
        self.record = record
        try:
            self._owner = connect_owner(record)
        except BaseException:
            with contextlib.suppress(Exception):  # nobody holds its record: a run left would only block
                end_run(record, timeout=10.0)
            raise
        return record

    def end_lost_run(self, record: RunRecord) -> list[str]:
        """A run whose supervisor is gone: interrupt the job it left on a Spark Connect server (by
        the run's tag, in the session its record holds), so that nothing of it holds the cluster
        while a retry starts afresh. Returns the operations interrupted (none for other runs)."""
        if record.connect_session_id is None or not self.target.is_connect:
            return []
        interrupted = interrupt_lost_run(
            self.target.connect_url or "", record.connect_session_id, record.run_id
        )
        self.log.warning(
            "Run %s's supervisor is gone; its Spark Connect job in session %s: %s.",
            record.run_id,
            record.connect_session_id,
            f"interrupted (operation {', '.join(interrupted)})" if interrupted else "none left to interrupt",
        )
        return interrupted

    def detach(self) -> None:
        """Leave the run on purpose (before deferring): it waits ``reattach_timeout`` for its next owner."""
        owner, self._owner = self._owner, None
        if owner is not None:
            try:
                owner.detach()
            finally:
                owner.close()

    def follow(
        self,
        record: RunRecord,
        handle: Callable[[Path | None], T],
        *,
        since: int = 0,
        wait_for_teardown: bool = False,
    ) -> T:
        """Own the run to its end, then hand ``handle`` rank 0's output file (a script's holds what it passed to ``set_output``).

        The run's log lines go to this hook's log (the kept ones from line ``since`` on first, when
        this is a new owner), its application to ``on_application``, its metrics to ``metrics`` (the
        history so far when this owner connected, then each new record; ``on_metrics`` hears of
        each), its final status to ``run_status`` and its world sizes to ``world_sizes``.
        A failed run raises what :meth:`run` would raise. The run is released (torn down) once the
        output is handled; when ``handle`` fails, it is kept for the next owner.

        A run that succeeded is handed over as soon as the driver's outcome is out, while Spark
        stops; its supervisor waits for that stop alone. ``wait_for_teardown``: return only once
        the supervisor has torn the run down (up to 40 s more), for a caller whose end would end
        the supervisor too (a task in a pod of its own).
        """
        # The same run (its record may have gained a deadline or a Connect operation since).
        same_run = self.record is not None and self.record.run_id == record.run_id
        owner = self._owner if self._owner is not None and same_run else None
        if owner is None:
            owner = connect_owner(record, since=since)
        self._owner, self.record = owner, record
        self.metrics, self.rank_step_times = split_summaries(list(owner.status.metrics))
        self.run_status, self.world_sizes = None, []
        if self.metrics and self.on_metrics and not owner.status.ended:
            self.on_metrics(self.metrics)  # a new owner of a run under way: the history so far at once
        try:
            status = self._follow_events(owner, record)
            (self.metrics, self.rank_step_times), self.run_status = (
                split_summaries(list(status.metrics)),
                status,
            )
            self.world_sizes = list(status.world_sizes)
            if status.state != "succeeded":
                self._release(owner, record, wait_for_teardown)
                raise_for_failure(status)
            with tempfile.TemporaryDirectory(prefix="torchdist-output-") as tmp:
                result = handle(owner.fetch_output(Path(tmp)))
            self._release(owner, record, wait_for_teardown)
            return result
        finally:
            self._owner = None
            owner.close()

    def _release(self, owner: OwnerConnection, record: RunRecord, wait_for_teardown: bool) -> None:
        """The run is over for this owner: its supervisor tears it down (waited for on request)."""
        owner.release()
        if wait_for_teardown and not owner.wait_closed(TEARDOWN_WAIT_S):
            self.log.warning(
                "Run %s's supervisor had not torn it down after %g s.", record.run_id, TEARDOWN_WAIT_S
            )

    def _follow_events(self, owner: OwnerConnection, record: RunRecord) -> RunStatus:
        """The run's events to this hook's log and callbacks, to its final status.

        Airflow's own ``execution_timeout`` interrupts this at the moment the operator's deadline
        stops the run: then the run is stopping and its ranks are checkpointing. It is told "stop"
        (again, if the deadline got there first) and followed to its end, so that the task log says
        how the stop went (the supervisor ends it within ``stop_grace_period``); then the timeout
        stands."""

        def follow() -> RunStatus:
            return follow_to_end(
                owner,
                record.run_id,
                on_line=lambda text: self.log.info("%s", text),
                on_application=self._application_started,
                on_metric=self._metric_reported,
            )

        try:
            return follow()
        except AirflowTaskTimeout:
            with contextlib.suppress(LifelineError, OSError, SparkSubmitFailed):
                owner.stop("timeout")
                follow()
            raise

    # -- stopping -----------------------------------------------------------------------------

    def stop_run(self, record: RunRecord) -> bool:
        """Stop a followed run at its deadline, from another thread: over this hook's lifeline when
        it owns the run, else over a new one. False when there is nothing to stop: the run has ended
        (its result may still be on its way to this hook, and is not thrown away)."""
        if self.run_status is not None:
            return False
        owner = self._owner
        try:
            if owner is not None and self.record is not None and self.record.run_id == record.run_id:
                owner.stop("timeout")
            else:
                end_run(record, timeout=15.0, why="timeout")
        except (LifelineError, OSError, SparkSubmitFailed) as exc:
            self.log.warning("Could not stop run %s at its deadline: %s", record.run_id, exc)
        return True
