"""``TorchDistributorTrigger``: a deferred task's run, owned from the triggerer until it ends.

A deferrable :class:`~airflow_provider_torchdist.operators.torch_distributor.TorchDistributorOperator`
starts its run under a detached supervisor, hands the run's record to this trigger and frees its
worker slot. The trigger becomes the run's owner over the lifeline
(:mod:`~airflow_provider_torchdist.supervision.lifeline`, ``kind="trigger"``), waits for the run to end, leaves
it (``detach``: the supervisor keeps the result for the task) and fires one event; the task resumes
in ``execute_complete`` and takes the log, metrics and result from the supervisor itself.

What the triggerer needs:

- **to reach the supervisor** at the record's ``host:port``: the worker machine that started the
  run, on the port its supervisor bound (the worker's ``bind_host``; loopback unless configured).
  A triggerer on another machine needs a route to that address;
- **the deployment's signing key** (``[torchdist] output_signing_key``, the same on every worker
  and triggerer): the owner credential is derived from it and the run id
  (:func:`~airflow_provider_torchdist.supervision.record.owner_secret`), so the trigger's kwargs hold no
  secret. A triggerer with another key is refused by the supervisor (an ``error`` event).

A lost lifeline (the supervisor's machine unreachable for a moment, a restarting triggerer) does
not lose the run: the supervisor waits ``reattach_timeout`` for an owner, and the trigger reconnects
with backoff for as long. ``on_kill`` (mark-failed, clear) stops the run; ``cleanup`` (every exit,
a triggerer restart included) only closes the connection.

Events (``TriggerEvent.payload``), each with the ``record`` the trigger was given (with a Spark
Connect run's operation added once the trigger has seen it):

- ``{"state": "succeeded" | "failed", "status": RunStatus.to_dict()}``: the run ended;
- ``{"state": "gone", "message": ...}``: no supervisor answered for ``reattach_timeout``;
- ``{"state": "timeout", "message": ..., "stop_report": ...}``: the record's ``deadline`` (the
  task's ``execution_timeout``) passed while the task was deferred; the trigger stopped the run
  (as ``on_kill`` does), logged its lines while it stopped and says how the stop went
  (``stop_report``); the task fails with ``AirflowTaskTimeout``;
- ``{"state": "error", "message": ...}``: the supervisor refused the credential, it cannot be derived,
  or the trigger itself failed (the task then stops the run).
"""

# size: one trigger class (serialize, run, on_kill, cleanup, and the reconnection with backoff) under
# the docstring that is its events' contract: about 300 lines, kept whole.

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.supervision.deadline import STOP_WAIT_S, seconds_left
from airflow_provider_torchdist.supervision.lifeline import (
    AppEvent,
    AsyncOwnerConnection,
    DoneEvent,
    ErrorEvent,
    LifelineError,
    LifelineUnreachable,
    LineEvent,
    RunGone,
    RunStatus,
)
from airflow_provider_torchdist.supervision.lifeline.retry import retry_unreachable_async
from airflow_provider_torchdist.supervision.lifeline_hosts import check_lifeline_address
from airflow_provider_torchdist.supervision.record import RunRecord, TaskBinding, owner_secret

CLASSPATH = "airflow_provider_torchdist.triggers.torch_distributor.TorchDistributorTrigger"
#: The longest wait between two connection attempts.
MAX_BACKOFF_S = 60.0
#: The longest single wait for a deadline asyncio is asked for (a deadline years away is fine).
MAX_WAIT_S = 10 * 365 * 86400.0
#: The most lines of a stopping run that go into the trigger's log (a chatty training's last ones
#: are not what a user needs from a stop).
MAX_STOP_LINES = 50
#: The most of a stopped run's error that goes into the timeout event (and the try's error).
MAX_REPORT_CHARS = 2000
#: One connection attempt (TCP connect and the mutual authentication).
CONNECT_TIMEOUT_S = 10.0
#: What a failed connection attempt raises when nothing answers (yet) at the supervisor's address:
#: worth retrying while the supervisor may still wait for an owner. Any other LifelineError at
#: connect (a refused credential, a broken handshake) is final.
_NOT_ANSWERING = (RunGone, LifelineUnreachable)


class _Unreachable(Exception):
    """No supervisor answered at the record's address for the whole ``reattach_timeout``."""


class TorchDistributorTrigger(BaseTrigger):
    """Own a supervised training run from the triggerer until it ends (see the module docstring).

    :param record: the run's :class:`~airflow_provider_torchdist.supervision.record.RunRecord` as a dict
        (``RunRecord.to_dict()``): its id, its supervisor's address and its ``reattach_timeout``.
    :param poll_interval: seconds before the first reconnection attempt; each next wait doubles,
        up to 60 s.
    :param task_binding: the task instance the run belongs to (a
        :class:`~airflow_provider_torchdist.supervision.record.TaskBinding`, or its dict): the
        deferring task's own, which the trigger proves it owns the run for. None only for a run
        started outside a task.

    Example::

        self.defer(trigger=TorchDistributorTrigger(record.to_dict()), method_name="execute_complete")
    """

    def __init__(
        self,
        record: dict[str, Any],
        poll_interval: float = 5.0,
        task_binding: TaskBinding | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # Validated here, in the task, so a bad record fails the defer, not the triggerer.
        try:
            binding = (
                task_binding
                if task_binding is None or isinstance(task_binding, TaskBinding)
                else TaskBinding.from_dict(task_binding)
            )
        except ValueError as exc:
            raise InvalidTrainingConfig(f"TorchDistributorTrigger's task_binding: {exc}") from None
        self._record = RunRecord.from_dict(record).bound_to(binding)
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, (int, float))
            or not math.isfinite(poll_interval)
            or poll_interval <= 0
        ):
            raise InvalidTrainingConfig(
                f"TorchDistributorTrigger's poll_interval must be a positive number of seconds, got "
                f"{poll_interval!r}."
            )
        self.record = self._record.to_dict()
        self.task_binding = None if binding is None else binding.to_dict()
        self.poll_interval = float(poll_interval)
        self._secret: bytes | None = None
        self._connection: AsyncOwnerConnection | None = None
        #: The run's final status once seen (then a deadline passing stops nothing).
        self._final: RunStatus | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {
            "record": self.record,
            "poll_interval": self.poll_interval,
            "task_binding": self.task_binding,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            yield await self._outcome_by_deadline()
        except Exception as exc:  # never a bare traceback: the task needs the record to stop the run
            self.log.exception("Waiting for run %s failed", self._record.run_id)
            yield self._event(
                "error", message=f"the trigger failed while waiting for the run: {type(exc).__name__}: {exc}"
            )

    async def _outcome_by_deadline(self) -> TriggerEvent:
        """The run's outcome; at the record's deadline (the task's ``execution_timeout``), the run is
        stopped instead and the event is ``timeout``, unless it had ended by then."""
        left = seconds_left(self._record.deadline)
        if left is None:
            return await self._outcome()
        # A scope, not a task of its own: cancelling the trigger cancels the wait inside it too.
        scope = asyncio.timeout(min(left, MAX_WAIT_S))
        try:
            async with scope:
                return await self._outcome()
        except TimeoutError:
            if not scope.expired():
                raise
        record = self._record
        if self._final is not None:  # it ended just as the deadline passed: its result stands
            await self._close()
            return self._event(self._final.state, status=self._final.to_dict())
        self.log.warning(
            "Run %s passed the task's execution_timeout while the task was deferred: stopping it.",
            record.run_id,
        )
        how = ""
        try:
            how = await self._stop_run("timeout", follow=True)
        except Exception as exc:  # the task makes sure the run ended (execute_complete)
            self.log.warning("Could not stop run %s at its deadline: %s", record.run_id, exc)
        return self._event(
            "timeout",
            message=f"run {record.run_id} passed the task's execution_timeout while the task was deferred",
            stop_report=how,
        )

    async def _outcome(self) -> TriggerEvent:
        record = self._record
        try:
            secret = await self._owner_secret()
        except Exception as exc:  # a missing, short or unreadable key, a failing secrets backend
            return self._event(
                "error",
                message=f"Cannot derive the owner credential of run {record.run_id} from the deployment's "
                f"signing key ([torchdist] output_signing_key): {exc}",
            )
        since = 0
        while True:
            try:
                connection = await self._connect(secret, since)
            except _Unreachable as exc:
                return self._event("gone", message=str(exc))
            except LifelineError as exc:
                return self._event("error", message=self._refused(exc))
            status: RunStatus | None = connection.status
            since = max(since, status.last_seq)
            if not status.ended:
                status, since = await self._wait_for_done(connection, since)
            if status is not None:
                self._final = status
                break
            await self._close()  # the lifeline dropped mid-run: reconnect, the run waits for us
        try:
            # The task takes the result next (execute_complete): leave on purpose, do not release.
            await connection.detach()
        except LifelineError as exc:
            self.log.warning(
                "Could not detach from run %s (%s); it keeps its result anyway.", record.run_id, exc
            )
        await self._close()
        return self._event(status.state, status=status.to_dict())

    async def _wait_for_done(
        self, connection: AsyncOwnerConnection, since: int
    ) -> tuple[RunStatus | None, int]:
        """The run's final status, or None when the lifeline closes first; and the last line seen."""
        try:
            async with contextlib.aclosing(connection.events()) as events:
                async for event in events:
                    if isinstance(event, LineEvent):
                        since = max(since, event.seq)
                    elif isinstance(event, AppEvent):
                        self.log.info(
                            "Run %s: Spark application %s (%s)",
                            self._record.run_id,
                            event.app_id,
                            event.ui_url,
                        )
                        if event.operation:  # a Connect run's job: the task can end it if the run is lost
                            self._record = self._record.with_operation(event.operation)
                            self.record = self._record.to_dict()
                    elif isinstance(event, ErrorEvent):
                        self.log.warning("Run %s's supervisor: %s", self._record.run_id, event.message)
                    elif isinstance(event, DoneEvent):
                        return event.status, since
        except LifelineError as exc:
            self.log.warning("The lifeline of run %s dropped (%s); reconnecting.", self._record.run_id, exc)
            return None, since
        self.log.warning(
            "The lifeline of run %s ended before the run did; reconnecting.", self._record.run_id
        )
        return None, since

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark-failed, clear): stop the run, then close."""
        await self._stop_run("killed")

    async def _stop_run(self, why: str, follow: bool = False) -> str:
        """Tell the run's supervisor to stop it (``why``: "killed", "timeout"), then close.

        With ``follow``, the run's lines while it stops go to the trigger's log (the task log) for
        up to ``STOP_WAIT_S``; returns how the stop went as far as seen ("" without ``follow``)."""
        record = self._record
        try:
            for attempt in range(2):
                connection = self._connection
                if connection is None:
                    secret = await self._owner_secret()
                    await self._check_address()
                    try:  # a supervisor busy with a connection flood is tried again, for a while
                        connection = self._connection = await retry_unreachable_async(
                            functools.partial(
                                AsyncOwnerConnection.connect,
                                record.host,
                                record.port,
                                record.run_id,
                                secret,
                                kind="trigger",
                                timeout=CONNECT_TIMEOUT_S,
                            )
                        )
                    except RunGone:
                        self.log.info("Run %s had already ended; nothing to stop.", record.run_id)
                        return "the run had already ended"
                try:
                    await connection.stop(why)
                except LifelineError:
                    if attempt:
                        raise
                    await self._close()  # the kept connection had dropped: once more on a new one
                    continue
                self.log.info("Stopped run %s at %s:%s.", record.run_id, record.host, record.port)
                return await self._follow_stop(connection) if follow else ""
        finally:
            await self._close()
        return ""  # (not reached: the second attempt returns or raises)

    async def _follow_stop(self, connection: AsyncOwnerConnection) -> str:
        """The run's lines while it stops (the supervisor's "stop requested ...", the ranks'
        checkpoints), into the trigger's log; its final error once it ended. Bounded: Airflow's own
        trigger timeout comes ``TRIGGER_TIMEOUT_MARGIN_S`` after the deadline, and the task makes
        sure the run ended anyway (``execute_complete``)."""
        run_id, shown = self._record.run_id, 0
        scope = asyncio.timeout(STOP_WAIT_S)
        try:
            async with scope, contextlib.aclosing(connection.events()) as events:
                async for event in events:
                    if isinstance(event, LineEvent) and shown < MAX_STOP_LINES:
                        shown += 1
                        self.log.info("Run %s: %s", run_id, event.text)
                    elif isinstance(event, DoneEvent):  # its error: bounded, it goes into the event
                        report = (event.status.error or f"the run {event.status.state}")[:MAX_REPORT_CHARS]
                        self.log.info("Run %s after the stop: %s", run_id, report)
                        return report
        except TimeoutError:
            if not scope.expired():
                raise
            return f"the run was still stopping {STOP_WAIT_S:g} s after the stop request"
        except LifelineError as exc:
            return f"the lifeline dropped while the run stopped ({exc})"
        return ""  # the lifeline closed with the run: the task's own check (execute_complete) follows

    async def cleanup(self) -> None:
        """Only close the lifeline: a triggerer restart must not stop the run (it waits for the next)."""
        await self._close()

    # -- helpers ----------------------------------------------------------------------------------

    async def _check_address(self) -> None:
        """The record's host must be on the lifeline allow-list (its task state may have been
        edited); a thread, as a configured host name may be resolved."""
        await asyncio.to_thread(check_lifeline_address, self._record.host, self._record.port)

    async def _owner_secret(self) -> bytes:
        if self._secret is None:
            # Reading the key may read a file or run a command ([torchdist] output_signing_key_cmd):
            # never on the event loop.
            self._secret = await asyncio.to_thread(owner_secret, self._record.run_id, None, self._record.task)
        return self._secret

    async def _connect(self, secret: bytes, since: int) -> AsyncOwnerConnection:
        """Become the run's owner; retry with backoff while nothing answers, for ``reattach_timeout``
        from the first failure (as long as the supervisor waits for an owner)."""
        record = self._record
        await self._check_address()
        delay, first_failure = self.poll_interval, None
        while True:
            try:
                self._connection = await AsyncOwnerConnection.connect(
                    record.host,
                    record.port,
                    record.run_id,
                    secret,
                    kind="trigger",
                    since=since,
                    timeout=CONNECT_TIMEOUT_S,
                )
                return self._connection
            except _NOT_ANSWERING as exc:
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                left = first_failure + record.reattach_timeout - now
                if left <= 0:
                    raise _Unreachable(
                        f"Run {record.run_id} is gone: its supervisor at {record.host}:{record.port} did not "
                        f"answer for {now - first_failure:.0f} s (reattach_timeout {record.reattach_timeout:g} s). "
                        f"The run ended and was torn down, or the triggerer cannot reach that address. "
                        f"Last error: {exc}"
                    ) from exc
                self.log.info(
                    "Run %s's supervisor at %s:%s does not answer (%s); retrying in %.1f s.",
                    record.run_id,
                    record.host,
                    record.port,
                    exc,
                    min(delay, left),
                )
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, MAX_BACKOFF_S)

    def _refused(self, exc: LifelineError) -> str:
        record = self._record
        return (
            f"The lifeline to run {record.run_id} at {record.host}:{record.port} failed: {exc}. When the "
            "supervisor refused the credential: the triggerer needs the same [torchdist] output_signing_key "
            "as the worker that started the run."
        )

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.close()
            except (LifelineError, OSError) as exc:
                self.log.debug("Closing the lifeline of run %s: %s", self._record.run_id, exc)

    def _event(self, state: str, **details: Any) -> TriggerEvent:
        return TriggerEvent({"state": state, "record": self.record, **details})
