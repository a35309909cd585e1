"""The supervisor's rules for its owners: who owns the run, and when the run is torn down for it.

:class:`OwnerRules` is the part of :class:`~airflow_provider_torchdist.supervision.run_supervisor.RunSupervisor`
the lifeline's threads call (``owner_attached``, ``owner_command``, ``owner_lost``). At most one
owner at a time: a new authenticated owner replaces the old one. An owner is lost when its
connection closes, or it is silent for ``OWNER_SILENCE_S``, without ``detach`` or ``release``
first. A run still training that loses a ``task`` owner and is not ``durable`` is torn down at
once; otherwise the supervisor waits ``reattach_timeout`` for the next owner, then tears down.
``stop`` tears down now; ``release`` tears an ended run down. All of it under one condition
(``_cond``), which the supervisor's own thread waits on (:meth:`OwnerRules._await_reason`).
"""

from __future__ import annotations

import threading
import time

from airflow_provider_torchdist.supervision.config import SupervisorConfig, log
from airflow_provider_torchdist.supervision.lifeline import OwnerSession, RunState

STOPPED_BY_OWNER = "stopped by its owner"


class OwnerRules:
    """The owner of one run, the deadline without one, and why the run is to be torn down."""

    def __init__(self, config: SupervisorConfig, state: RunState, silence_s: float) -> None:
        self.config = config
        self.state = state
        self._silence_s = silence_s
        self._cond = threading.Condition()
        self._owner: OwnerSession | None = None
        self._deadline: float | None = None
        self._waited = 0.0
        self._reason: str | None = None
        self._run_error: str | None = None
        self._stop_why: str | None = None

    @property
    def run_id(self) -> str:
        return self.config.run_id

    def _first_owner_wait(self) -> float:
        # The task connects right after the address appears. If it died meanwhile, a run that is
        # not durable must not wait long for it.
        if self.config.durable:
            return self.config.reattach_timeout
        return min(self.config.reattach_timeout, self._silence_s)

    def _await_reason(self) -> str | None:
        """Block until a teardown is asked for, or no owner came before the deadline; returns why."""
        with self._cond:
            while self._reason is None:
                now = time.monotonic()
                if self._deadline is not None and now >= self._deadline:
                    self._reason = self._orphan_reason()
                    break
                self._cond.wait(None if self._deadline is None else self._deadline - now)
            reason = self._reason
        return reason

    def _wait_for_owner(self, seconds: float) -> None:
        """Tear down in ``seconds`` unless an owner attaches (under ``_cond``)."""
        self._deadline, self._waited = time.monotonic() + seconds, seconds

    def _orphan_reason(self) -> str:
        what = "its output was not taken" if self.state.ended else "it had not ended"
        return f"no owner came within {self._waited:g} s and {what}"

    # -- owners (called by the lifeline's threads)

    def owner_attached(self, owner: OwnerSession) -> None:
        with self._cond:
            if self._reason is not None:
                return  # not an owner any more: it gets the end of the run, then the lifeline closes
            old, self._owner, self._deadline = self._owner, owner, None
        if old is not None:
            old.close(f"another owner ({owner.kind}, from {owner.peer}) took run {self.run_id} over")
        log(f"owner attached: {owner.kind} from {owner.peer}{' (replacing ' + old.kind + ')' if old else ''}")

    def owner_command(self, owner: OwnerSession, command: str, why: str | None = None) -> str | None:
        with self._cond:
            if owner is not self._owner:
                return f"this lifeline is no longer the owner of run {self.run_id}"
            if command == "stop":
                log(f"stop from its owner ({owner.kind}){f': {why}' if why else ''}")
                stopped = f"{STOPPED_BY_OWNER} ({why})" if why else STOPPED_BY_OWNER
                self._request(stopped, run_error=stopped, stop_why=why or STOPPED_BY_OWNER)
            elif command == "detach":
                self._owner = None
                self._wait_for_owner(self.config.reattach_timeout)
                log(
                    f"owner {owner.kind} detached; waiting up to {self.config.reattach_timeout:g} s for the next"
                )
                owner.close("detached")
            elif command == "release":
                if not self.state.ended:
                    return (
                        f"run {self.run_id} is still {self.state.state}: release is for a run that has ended "
                        "(once its output is taken). Send stop to end it."
                    )
                log(f"released by its owner ({owner.kind})")
                self._request("released by its owner")
            self._cond.notify_all()
        return None

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        with self._cond:
            if owner is not self._owner:
                return  # replaced, detached, or already tearing down
            self._owner = None
            if self._reason is not None:
                return
            if not self.state.ended and not self.config.durable and owner.kind == "task":
                log(f"owner {owner.kind} lost ({why}); the run is not durable")
                self._request(f"its task lost the lifeline ({why}) and the run is not durable")
            else:
                self._wait_for_owner(self.config.reattach_timeout)
                log(
                    f"owner {owner.kind} lost ({why}); waiting up to {self.config.reattach_timeout:g} s for the next"
                )
            self._cond.notify_all()

    # -- teardown requests

    def request_teardown(self, reason: str) -> None:
        """Tear down soon (from any thread; the thread in ``RunSupervisor.serve`` does it)."""
        with self._cond:
            self._request(reason)
            self._cond.notify_all()

    def _request(self, reason: str, run_error: str | None = None, stop_why: str | None = None) -> None:
        """The first teardown asked for wins: ``reason`` for the log, ``run_error`` for a run that
        had not ended, ``stop_why`` for its ranks ("timeout"; default: ``reason``)."""
        if self._reason is None:
            self._reason = reason
            self._run_error = run_error
            self._stop_why = stop_why or reason
