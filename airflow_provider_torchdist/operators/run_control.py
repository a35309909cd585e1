"""The operator's run control: its run's record in ``task_state_store`` (Airflow's
``ResumableJobMixin``), the deferral's way back, and owning the run to its end.

:class:`SupervisedRunMixin` is the half of
:class:`~airflow_provider_torchdist.operators.torch_distributor.TorchDistributorOperator` that
runs after rendering: the operator gives it a hook (``self._hook``, from ``make_hook``) and its
settings (``durable``, ``retries``, ``execution_timeout``, ``outlets``); it starts, reattaches to,
follows and stops the run, and turns the run's end into the task's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from airflow.providers.common.compat.sdk import ResumableJobMixin

from airflow_provider_torchdist.errors import SparkSubmitFailed
from airflow_provider_torchdist.operators.checkpoint_registry import best_checkpoint, finish_checkpoints
from airflow_provider_torchdist.operators.executors import pod_bound, task_executor
from airflow_provider_torchdist.operators.outlet_events import run_extra, set_outlet_extra
from airflow_provider_torchdist.operators.tracking import task_run as tracking
from airflow_provider_torchdist.operators.xcom import (
    link_pusher,
    metrics_pusher,
    output_handler,
    push_checkpoint_dir,
    push_world_sizes,
)
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.supervision.deadline import (
    DeadlineWatch,
    seconds_left,
    timeout_error,
    try_deadline,
)
from airflow_provider_torchdist.supervision.record import RECORD_KEY, RunRecord, TaskBinding
from airflow_provider_torchdist.supervision.task_side import (
    ACTIVE_STATES,
    GONE,
    end_run,
    run_state,
    stop_abandoned,
)

if TYPE_CHECKING:
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook

#: What Airflow's scheduler stores for a deferred task whose trigger timed out (``next_method`` and
#: ``next_kwargs["error"]``): values kept in the metadata DB, so stable across releases, while the
#: constants naming them are Airflow's internals.
AIRFLOW_TRIGGER_FAIL = "__fail__"
AIRFLOW_TRIGGER_TIMEOUT = "Trigger timeout"

#: ``get_job_status`` of a run whose task was cleared since it started: never reattached to.
CLEARED = "cleared"


def held_record(data: Any, context: Any) -> RunRecord:
    """A stored run record as this task instance holds it: bound to the task instance from the
    context, never to whatever the stored data says (see :mod:`~airflow_provider_torchdist.supervision.record`)."""
    return RunRecord.from_dict(data).bound_to(TaskBinding.of(context.get("ti")))


def _cleared_since(record: RunRecord, context: Any) -> bool:
    """Whether the task was cleared since the run started: Airflow raised its ``max_tries``."""
    max_tries = getattr(context.get("ti"), "max_tries", None)
    return record.max_tries is not None and type(max_tries) is int and max_tries > record.max_tries


class SupervisedRunMixin(ResumableJobMixin):
    """Start, reattach to, follow and stop the task's run (see the module docstring)."""

    #: Where the run's record lives in ``task_state_store`` between tries (ResumableJobMixin).
    external_id_key = RECORD_KEY
    _hook: TorchDistributorHook | None
    _result: Any
    _followed: bool
    _tracking: tracking.TaskTracking | None

    # -- ResumableJobMixin: the run's record in task_state_store ---------------------------------

    def submit_job(self, context: Any) -> dict[str, Any]:
        """Start the run under its supervisor; its record is what a retry reattaches with."""
        assert self._hook is not None
        record = self._hook.start_run(
            self.train_object,
            self.train_args,
            self.train_kwargs,
            durable=self.durable,
            reattach_timeout=self._hook_spec().reattach_timeout,
            task=TaskBinding.of(context["ti"]),
        )
        ti = context["ti"]
        deadline = try_deadline(ti, self.execution_timeout)
        max_tries = getattr(ti, "max_tries", None)
        max_tries = max_tries if type(max_tries) is int and max_tries >= 0 else None
        return dataclasses.replace(record, deadline=deadline, max_tries=max_tries).to_dict()

    def get_job_status(self, external_id: Any, context: Any) -> str:
        """The stored run's state (``"gone"`` when its supervisor is not there any more). A failed
        run still kept for its owner is ended here, so that its checkpoint lock is free for the next."""
        record = held_record(external_id, context)
        if _cleared_since(record, context):
            # A clear asks for a new run. The old one may not know yet: a deferred task's trigger
            # stops it when the triggerer gets to it, which can be after this try starts.
            self.log.warning(
                "The task was cleared since run %s started: stopping it, and starting a new run.",
                record.run_id,
            )
            end_run(record, why="cleared")
            return CLEARED
        state = run_state(record)
        if state == "failed":
            self.log.warning(
                "The earlier run %s failed; starting afresh from its checkpoints.", record.run_id
            )
            end_run(record)
        elif state in ACTIVE_STATES:
            self.log.info(
                "Reattaching to run %s at %s:%s (%s).", record.run_id, record.host, record.port, state
            )
        elif state == GONE:
            self._end_lost_run(record)
        return state

    def is_job_active(self, status: str) -> bool:
        return status in ACTIVE_STATES

    def is_job_succeeded(self, status: str) -> bool:
        return status == "succeeded"

    def poll_until_complete(self, external_id: Any, context: Any) -> Any:
        """Own the run to its end; returns what goes to XCom (the mixin returns this on a reattach)."""
        self._result = self._follow(held_record(external_id, context), context, ended=False)
        self._followed = True
        return self._result

    def get_job_result(self, external_id: Any, context: Any) -> Any:
        if self._followed:
            return self._result
        # An earlier try's run that succeeded and still holds its result: take it over.
        return self._follow(held_record(external_id, context), context, ended=True)

    # -- deferral ---------------------------------------------------------------------------------

    def _live_run(self, context: Any) -> RunRecord | None:
        """An earlier try's run this try can take over when deferring, or None (a failed one ended)."""
        store = context.get("task_state_store")
        stored = store.get(self.external_id_key) if store is not None else None
        if not stored or not self.durable:
            return None
        record = held_record(stored, context)
        state = self.get_job_status(stored, context)
        return record if state in (*ACTIVE_STATES, "succeeded") else None

    def _submit(self, context: Any) -> RunRecord:
        record = self.submit_job(context)
        store = context.get("task_state_store")
        if store is not None:
            store.set(self.external_id_key, record)
        return held_record(record, context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Back from the trigger: take the run's log, result and metrics as the synchronous path would."""
        self._check_work(at_parse_time=False)
        self._hook = self.make_hook(context)
        # It has trained: a tracking server that does not answer now does not fail the task.
        self._tracking = tracking.open_for(self, self._hook, context, required=False)
        state = event.get("state")
        record = held_record(event["record"], context)
        if state == "timeout":  # the trigger stopped the run at its deadline
            self._end_timed_out(record)
            how = event.get("stop_report")  # how the stop went, as the trigger saw it
            raise timeout_error(record.run_id, record.deadline, "while the task was deferred", str(how or ""))
        if state in ("error", "gone"):
            if state == "error":
                # The task fails: a run still there would hold its application and checkpoint lock
                # for reattach_timeout with nobody to come back for it.
                try:
                    end_run(record)
                except Exception as exc:  # the lifeline is what failed: say so, raise the trigger's error
                    self.log.warning("Could not stop run %s: %s", record.run_id, exc)
            else:
                self._end_lost_run(record)
            raise SparkSubmitFailed(f"Waiting for the training run failed: {event.get('message') or state}")
        return self._follow(record, context, ended=True)  # the trigger saw it end

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        """Airflow's own trigger timeout (``defer(timeout=...)``) fails a deferred task without a
        word to the trigger: stop the run from its record first, then fail as a timeout."""
        error = (next_kwargs or {}).get("error")
        if next_method == AIRFLOW_TRIGGER_FAIL and error == AIRFLOW_TRIGGER_TIMEOUT:
            store = context.get("task_state_store")
            stored = store.get(self.external_id_key) if store is not None else None
            if stored:
                record = held_record(stored, context)
                self._end_timed_out(record)
                raise timeout_error(record.run_id, record.deadline, "while the task was deferred")
        return super().resume_execution(next_method, next_kwargs, context)

    def _end_timed_out(self, record: RunRecord) -> None:
        """Make sure a run stopped at its deadline is gone (its lock free for a retry) before the
        try fails; the timeout stays the task's error."""
        try:
            end_run(record, timeout=15.0, why="timeout")
        except Exception as exc:
            self.log.warning("Could not make sure run %s ended at its timeout: %s", record.run_id, exc)

    def _record_operation(self, store: Any, record: RunRecord, operation: str) -> None:
        """A Connect run's operation (and the session it ran in) into its record, for a retry that
        finds the supervisor gone (``end_lost_run``); the run goes on whether it is stored or not."""
        try:
            store.set(self.external_id_key, record.with_operation(operation).to_dict())
        except Exception as exc:
            self.log.warning(
                "Could not add Spark Connect operation %s to run %s's record: %s",
                operation,
                record.run_id,
                exc,
            )

    def _end_lost_run(self, record: RunRecord) -> None:
        assert self._hook is not None
        try:
            self._hook.end_lost_run(record)
        except Exception as exc:  # what the task does next says its own error
            self.log.warning(
                "Could not interrupt the Spark Connect job of lost run %s: %s", record.run_id, exc
            )

    # -- owning the run ---------------------------------------------------------------------------

    def _hook_spec(self) -> TrainingSpec:
        assert self._hook is not None
        return self._hook.spec

    def _follow(self, record: RunRecord, context: Any, *, ended: bool) -> Any:
        """Follow the run to its end as its owner and turn rank 0's output into the XCom value; the
        metric history goes to XCom as it grows (throttled) and whole at the end, and a succeeded
        run's world sizes to XCom and its summary into the events of the ``outlets`` assets.

        A run still going (not ``ended``) is held to its deadline: one already past is stopped
        before it is followed, else a :class:`DeadlineWatch` stops it when the deadline passes."""
        hook = self._hook
        assert hook is not None
        ti = context["ti"]
        deadline = None if ended else record.deadline
        if deadline is not None and seconds_left(deadline) == 0:
            self.log.warning("Run %s is past its execution_timeout: stopping it.", record.run_id)
            self._end_timed_out(record)
            raise timeout_error(record.run_id, deadline, "before this try could take it over")
        push_checkpoint_dir(ti, hook.spec)  # on every path that owns the run: after a deferral too
        hook.on_application = link_pusher(ti)
        if (store := context.get("task_state_store")) is not None:
            hook.on_operation = lambda operation: self._record_operation(store, record, operation)
        metrics = metrics_pusher(ti)
        hook.on_metrics = metrics.offer
        tracking.attach(self._tracking, hook)  # the MLflow run's share, off this loop (operators/tracking/)
        followed, value = False, None
        try:
            with DeadlineWatch(deadline, lambda: hook.stop_run(record)) as watch:
                try:
                    # In a pod of its own, Spark's stop would end with the task: wait for it.
                    value = hook.follow(
                        record, output_handler(ti, hook.spec), wait_for_teardown=pod_bound(task_executor(ti))
                    )
                except Exception as exc:
                    if watch.expired:  # the run failed because the watch stopped it
                        raise timeout_error(record.run_id, deadline, "while it trained") from exc
                    raise
            followed = True
        except Exception:
            stop_abandoned(record, context["ti"].try_number <= (self.retries or 0), self.log)
            raise
        finally:
            tracked = self._end_follow(metrics, context, value, followed)
        push_world_sizes(ti, hook.world_sizes, getattr(hook, "rank_step_times", []))
        extra = tracked | best_checkpoint(finish_checkpoints(ti, hook.spec, self.log))  # XCom checkpoints
        if self.outlets and hook.run_status is not None:
            # The size it ended with: an elastic run's last one, else the one it had throughout.
            world_size = hook.world_sizes[-1]["world_size"] if hook.world_sizes else hook.spec.max_processes
            set_outlet_extra(context, self.outlets, run_extra(hook.run_status, value, world_size) | extra)
        return value

    def _end_follow(self, metrics: Any, context: Any, value: Any, followed: bool) -> dict[str, Any]:
        """The MLflow run closed (returns its share of the asset event's extra); the final metric
        history to XCom, after a failure too, where a failed push must not hide the run's error."""
        hook = self._hook
        assert hook is not None
        tracked = tracking.close_tracking(
            self._tracking, hook, context, value=value, succeeded=followed, log_model=self.mlflow_log_model
        )
        try:
            metrics.close(hook.metrics or None)
        except Exception:
            if followed:
                raise
            self.log.warning("Could not push the final metric history.", exc_info=True)
        return tracked
