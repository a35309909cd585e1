"""The driver's hang watchdog: it finds a hung run, puts every rank's stacks in the task log with the
suspects named, and stops the run (see docs/hangs.md).

:class:`HangWatch` checks the run channel's :class:`~.hang_detection.HangDetector` every second.
When a rank has made no progress for ``hang_timeout`` seconds, it

1. asks every rank for its stacks (a :class:`~airflow_provider_torchdist.spark.wire.watchdog_messages.StackRequest`)
   and waits up to :data:`STACKS_WAIT_S` for the answers; a rank that does not answer is silent;
2. prints every rank's stacks, one summary line per rank and the suspects;
3. gives the run the graceful stop (:mod:`.stop_fanout`, reason :data:`HUNG`, ``stop_grace_period``)
   and, after the grace period (at once when no live rank's code watches for stops), ends what is
   left with ``hard_stop``: in local mode it kills the ranks (its own children, by PID), on a
   cluster it cancels the barrier stage;
4. leaves the run's error in :attr:`HangWatch.error` (it starts with
   :data:`~.hang_detection.HUNG_ERROR_PREFIX`): the task fails with ``TrainingHung``.

An elastic run passes ``survive``: between 2 and 3 it may turn the hang into a node loss (the
suspects' nodes leave, :mod:`~airflow_provider_torchdist.spark.elastic.hung_nodes`); when it did,
the run goes on, and the watch starts over on the ranks that are left.

While the run is not hung it also looks for stragglers (:mod:`.stragglers`), and at the end adds
each rank's mean step time and compute share to the run's metrics.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from airflow_provider_torchdist.spark.driver.hang_detection import HangDetector, HangVerdict
from airflow_provider_torchdist.spark.driver.stop_fanout import StopFanout
from airflow_provider_torchdist.spark.driver.stragglers import StragglerCheck, step_time_records
from airflow_provider_torchdist.spark.wire.protocol import StackRequest, encode

if TYPE_CHECKING:
    from airflow_provider_torchdist.spark.driver.channel import RunChannel
    from airflow_provider_torchdist.spec import TrainingSpec

#: The stop's reason, as the ranks' ``stop_details()`` and the log give it.
HUNG = "hung"
#: How long the ranks get to answer for their stacks (a live rank answers in milliseconds).
STACKS_WAIT_S = 5.0
#: How often the driver looks for a rank without progress.
CHECK_EVERY_S = 1.0


def parent_of(pid: int) -> int | None:
    """``pid``'s parent process, from ``/proc`` (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def kill_own_children(pids: list[int]) -> list[int]:
    """SIGKILL each of ``pids`` that is a child of this process (local mode: the ranks torchrun's
    agent forked here); a PID a rank sent that is not ours is left alone. Returns those killed."""
    killed = []
    for pid in pids:
        if pid > 1 and parent_of(pid) == os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)  # a SIGSTOPped rank ends too
                killed.append(pid)
            except OSError:
                pass
    return killed


class HangWatch:
    """Watches ``ranks`` for a hang while the run trains (see the module docstring).

    ``say`` prints a line of the driver's own in the task log; ``stops`` is the run channel's stop
    fanout; ``hard_stop`` ends what is left of the run, given the ranks' PIDs.

    Example::

        with HangWatch(channel.hangs, channel.stops, channel.say, hang_timeout=300, grace=30,
                       hard_stop=kill_own_children) as hangs:
            launch_node(...)
        hangs.error  # "training hung: ..." or None
    """

    def __init__(
        self,
        ranks: HangDetector,
        stops: StopFanout,
        say: Callable[[str], None],
        *,
        hang_timeout: float | None,
        grace: float,
        hard_stop: Callable[[list[int]], object],
        every: float = CHECK_EVERY_S,
        stacks_wait: float = STACKS_WAIT_S,
        publish: Callable[[dict], None] | None = None,
        survive: Callable[[HangVerdict], bool] | None = None,
    ) -> None:
        """``publish``: adds a record to the run's metrics (each rank's step time, at the end);
        ``survive``: given the verdict, True when it dealt with the hang so that the run goes on."""
        self.ranks, self._stops, self._say, self._hard_stop = ranks, stops, say, hard_stop
        self._publish, self._survive = publish, survive
        self.stragglers = StragglerCheck(say)
        self.hang_timeout, self._grace = hang_timeout, grace
        self._every, self._stacks_wait = every, stacks_wait
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchdist-hang-watch", daemon=True)
        #: The verdict and the run's error, once it was found hung.
        self.verdict: HangVerdict | None = None
        self.error: str | None = None
        self._ended = False

    def __enter__(self) -> HangWatch:
        if self.hang_timeout:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self.hang_timeout and self._publish is not None:
            try:
                for record in step_time_records(self.ranks.every_rank()):
                    self._publish(record)
            except Exception as exc:  # the step times must never fail (or hide the end of) a run
                self._say(f"each rank's step time was not recorded: {exc!r}")

    def _run(self) -> None:
        while not self._done.wait(self._every):
            try:
                if self.verdict is None:
                    if not self.check():
                        self.stragglers.check(self.ranks.every_rank())
                elif self._ended and self.ranks.ranks():
                    # torchrun may restart the worker group (max_restarts): the hung run stays ended.
                    self._hard_stop(self.ranks.pids())
            except Exception as exc:  # the watch must never take the run down with it
                self._say(f"the hang watchdog stopped: {exc!r}")
                return

    def check(self, now: float | None = None) -> bool:
        """Look once; True when the run was found hung (and then stopped; an elastic run that went on
        without the hung nodes was not)."""
        if self.hang_timeout is None or self.verdict is not None or self._stops.request is not None:
            return False  # off, found already, or stopping already (its stopper ends it)
        stalled = self.ranks.stalled(self.hang_timeout, time.monotonic() if now is None else now)
        if not stalled:
            return False
        return self._hung(stalled)

    def _hung(self, stalled: list[int]) -> bool:
        assert self.hang_timeout is not None
        self._say(
            f"no progress from rank(s) {stalled} for hang_timeout={self.hang_timeout:g} s: the run looks "
            "hung; asking every rank for its Python stacks"
        )
        for key in self.ranks.keys():
            _send(key)
        self.ranks.wait_for_stacks(self._stacks_wait)
        verdict = self.verdict = self.ranks.verdict(self.hang_timeout, stalled, time.monotonic())
        for state in verdict.ranks:
            if state.stacks is not None:
                self._say(f"stacks of {state.prefix}:")
                for line in state.stacks.text.splitlines():
                    self._say(f"  {line}")
                if state.stacks.nccl_trace:
                    self._say(f"{state.prefix} dumped NCCL's flight recorder to {state.stacks.nccl_trace}")
        for state in verdict.ranks:
            self._say(f"hang: {verdict.summary(state)}")
        self._say(f"hang: {verdict.suspect_line()}")
        if self._survive is not None and self._survive(verdict):
            self.ranks.start_over(time.monotonic())
            self.verdict = None  # the run went on without the suspects: watch what is left
            return False
        error = verdict.error(self._grace)

        def fail_the_run(_: int) -> None:
            self.error = error  # before any rank has the stop: the run may end as soon as they return

        if self._stops.stop(HUNG, self._grace, before_sending=fail_the_run):
            self._end_after_grace(verdict.silent)
        return True

    def _end_after_grace(self, silent: list[int]) -> None:
        """End what is left once the grace period is out, or at once when no live rank watches."""
        self._say(
            f"the run is stopped: the ranks have stop_grace_period={self._grace:g} s to checkpoint and "
            "return, then what is left of it is ended"
        )
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline and not self._nobody_watches(silent):
            if self._done.wait(0.1) or not self.ranks.ranks():
                return  # the run ended, or every rank returned
        self._say("ending what is left of the hung run: its ranks are killed")
        self._ended = True
        self._hard_stop(self.ranks.pids())

    def _nobody_watches(self, silent: list[int]) -> bool:
        """Every live rank answered the stop, and none of their code watches for stops."""
        answers = dict(self._stops.answers)
        live = self.ranks.ranks() - set(silent)
        return live <= set(answers) and not any(answers.get(r) for r in live)


def _send(key: object) -> None:
    if isinstance(key, socket.socket):
        try:
            key.sendall(encode(StackRequest()))
        except OSError:
            pass  # the rank is gone already


def watch_hangs(
    channel: RunChannel,
    spec: TrainingSpec,
    hard_stop: Callable[[list[int]], object],
    survive: Callable[[HangVerdict], bool] | None = None,
) -> HangWatch:
    """The hang watch of a run on ``channel`` with ``spec``'s ``hang_timeout`` and grace period
    (``survive``: an elastic run's, see :class:`HangWatch`)."""
    return HangWatch(
        channel.hangs,
        channel.stops,
        channel.say,
        hang_timeout=spec.hang_timeout,
        grace=spec.stop_grace_period,
        hard_stop=hard_stop,
        publish=channel.publish_metric,
        survive=survive,
    )
