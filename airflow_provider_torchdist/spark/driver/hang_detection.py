"""What the driver knows of each rank's progress, and its verdict on a hung run: a plain object
that the run channel feeds and tests drive without sockets (:mod:`.hang_watch` acts on it).

Each connected rank's watchdog (:mod:`~airflow_provider_torchdist.spark.node.watchdog`) sends a
:class:`~airflow_provider_torchdist.spark.wire.watchdog_messages.Progress` every few seconds. A rank
*progresses* when its counts grow (events: ``report()``, ``stop_requested()``, a callback's step;
moves: its main thread seen elsewhere in the Python code than the sample before; collectives
issued on its default process group). The run is hung
when a rank has not progressed for ``hang_timeout`` seconds: none progressed, or some did while
others did not. Then every rank is asked for its stacks; the :class:`HangVerdict` names the
suspects: the ranks that did not answer (silent: frozen), and the ranks not in a collective while
others wait in one. Each rank's counts and mean gap between events stay here for later readers
(a straggler check compares ``event_gap_s``).

Example::

    ranks = HangDetector()
    ranks.connected("conn-0", rank=0, host="10.0.0.1", now=0.0)
    ranks.progress("conn-0", Progress(1, 0, None, "train.py:9 in train", "all_reduce", 41), now=2.0)
    ranks.stalled(hang_timeout=30.0, now=40.0)   # [0]
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from airflow_provider_torchdist.spark.wire.outcome import HUNG_ERROR_PREFIX
from airflow_provider_torchdist.spark.wire.protocol import rank_prefix
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress, Stacks


@dataclass
class RankProgress:
    """One connected rank's progress, as its messages told it (times: the driver's monotonic clock)."""

    rank: int
    host: str | None
    last_seen: float
    #: When its counts last grew (its connection's time until they do).
    last_progress: float
    events: int = 0
    moves: int = 0
    collectives: int = 0
    event_gap_s: float | None = None
    where: str | None = None
    waits_in: str | None = None
    pid: int | None = None
    stacks: Stacks | None = None
    #: The node (Spark task) it runs on; an elastic run drops a hung node (spark/elastic/hung_nodes.py).
    node: int | None = None
    #: Samples of its main thread, and those not waiting in torch.distributed (its compute share).
    samples: int = 0
    busy: int = 0
    #: ``(time, events)`` when its events were first seen, and when they last grew: its mean step time.
    first_events: tuple[float, int] | None = None
    last_events: tuple[float, int] | None = None

    @property
    def mean_step_time_s(self) -> float | None:
        """Seconds per progress event (a step, for a loop that reports or a callback) between the
        first and the last message that counted events; None before two such messages."""
        if self.first_events is None or self.last_events is None:
            return None
        (t0, e0), (t1, e1) = self.first_events, self.last_events
        return (t1 - t0) / (e1 - e0) if e1 > e0 else None

    @property
    def prefix(self) -> str:
        return rank_prefix(self.rank, self.host)


@dataclass
class HangVerdict:
    """Who is where in a hung run, once the ranks' stacks are in (or their wait is over)."""

    hang_timeout: float
    #: The ranks without progress for ``hang_timeout``, and every rank's state then.
    stalled: list[int]
    ranks: list[RankProgress]
    now: float
    silent: list[int] = field(init=False)
    waiting: list[int] = field(init=False)
    suspects: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.silent = [r.rank for r in self.ranks if r.stacks is None]
        self.waiting = [r.rank for r in self.ranks if r.stacks is not None and r.stacks.waits_in]
        elsewhere = [r.rank for r in self.ranks if r.stacks is not None and not r.stacks.waits_in]
        if self.waiting:  # the ranks the others wait for: not in a collective, or frozen
            self.suspects = sorted(self.silent + elsewhere)
        else:  # nobody waits in a collective: the stalled ranks themselves (a deadlock, a sleep)
            self.suspects = sorted(set(self.silent) | (set(self.stalled) & set(elsewhere)))

    def _of(self, rank: int) -> RankProgress:
        return next(r for r in self.ranks if r.rank == rank)

    def summary(self, state: RankProgress) -> str:
        """One line on one rank: where it is, and whether it waits in a collective or sits elsewhere."""
        quiet = f"no progress for {self.now - state.last_progress:.0f} s"
        if state.stacks is None:
            last = f"; last seen at {state.where}" if state.where else ""
            return (
                f"{state.prefix} is silent: nothing from it for {self.now - state.last_seen:.0f} s and no "
                f"answer for its stacks (stopped by SIGSTOP or a debugger, or stuck in native code that "
                f"holds the GIL){last}"
            )
        where = state.stacks.where
        if state.stacks.waits_in:
            return f"{state.prefix} waits in a collective (torch.distributed {state.stacks.waits_in}) at {where} ({quiet})"
        return f"{state.prefix} is not in a collective: at {where} ({quiet})"

    def suspect_line(self) -> str:
        """Who the run waits for, and why they are suspected."""
        if not self.suspects:
            waits = ", ".join(f"rank {r} in {self._of(r).stacks.waits_in}" for r in self.waiting)  # type: ignore[union-attr]
            return (
                f"every rank waits in a collective ({waits}): they called different collectives, or the "
                "same ones in a different order or with different sizes; compare where each waits"
            )
        named = ", ".join(f"rank {r} on {self._of(r).host or 'this host'}" for r in self.suspects)
        if self.waiting:
            why = f"not in a collective, or silent, while rank(s) {self.waiting} wait in one"
        else:
            why = "silent" if set(self.suspects) <= set(self.silent) else "without progress, in no collective"
        return f"suspect: {named} ({why})"

    def error(self, grace: float) -> str:
        """The run's error: what hung, who is suspected and where, what was done."""
        where = "; ".join(
            f"rank {r}: silent" if self._of(r).stacks is None else f"rank {r} at {self._of(r).stacks.where}"  # type: ignore[union-attr]
            for r in self.suspects
        )
        return (
            f"{HUNG_ERROR_PREFIX}no progress from rank(s) {self.stalled} for hang_timeout="
            f"{self.hang_timeout:g} s; {self.suspect_line()}{f' ({where})' if where else ''}. Every rank's "
            f"stacks are in the task log. The run was stopped (stop_grace_period={grace:g} s): a retry "
            "resumes from the last checkpoint. A healthy step that blocks longer needs a larger hang_timeout."
        )


class HangDetector:
    """Every connected rank's progress (see the module docstring). Thread-safe.

    Each rank's connection is a ``key`` (the driver's socket; anything hashable for tests), so a
    restarted rank's new connection starts afresh while its old one ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[Hashable, RankProgress] = {}
        #: The last state of each rank whose connection ended (its step times outlive it).
        self._ended: dict[int, RankProgress] = {}
        self.asked = threading.Condition(self._lock)

    def connected(
        self, key: Hashable, rank: int, host: str | None, now: float, node: int | None = None
    ) -> None:
        with self._lock:
            self._ranks[key] = RankProgress(rank, host, last_seen=now, last_progress=now, node=node)

    def gone(self, key: Hashable) -> None:
        """A rank's connection ended: it returned (or died, which its agent reports); not hung."""
        with self._lock:
            state = self._ranks.pop(key, None)
            if state is not None:
                self._ended[state.rank] = state
            self.asked.notify_all()

    def progress(self, key: Hashable, msg: Progress, now: float) -> None:
        with self._lock:
            state = self._ranks.get(key)
            if state is None:
                return
            collectives = msg.collectives if msg.collectives is not None else state.collectives
            if msg.events > state.events or msg.moves > state.moves or collectives > state.collectives:
                state.last_progress = now
            state.last_seen = now
            state.events, state.moves, state.collectives, state.pid = (
                msg.events,
                msg.moves,
                collectives,
                msg.pid,
            )
            state.where, state.waits_in = msg.where, msg.waits_in
            if msg.event_gap_s is not None:
                state.event_gap_s = msg.event_gap_s
            if msg.samples is not None and msg.busy is not None:
                state.samples, state.busy = msg.samples, msg.busy
            if msg.events > 0 and state.first_events is None:
                state.first_events = (now, msg.events)
            elif state.first_events is not None and msg.events > state.first_events[1]:
                state.last_events = (now, msg.events)

    def answered(self, key: Hashable, msg: Stacks) -> None:
        """A rank's stacks, after a request."""
        with self._lock:
            state = self._ranks.get(key)
            if state is not None:
                state.stacks = msg
                self.asked.notify_all()

    def stalled(self, hang_timeout: float, now: float) -> list[int]:
        """The ranks that have not progressed for ``hang_timeout`` seconds."""
        with self._lock:
            return sorted({s.rank for s in self._ranks.values() if now - s.last_progress >= hang_timeout})

    def start_over(self, now: float) -> None:
        """After a hang the run survived (an elastic run dropped the hung node): every live rank's
        clock starts again at ``now`` and its stacks are forgotten, so a later hang is found anew."""
        with self._lock:
            for state in self._ranks.values():
                state.last_progress, state.stacks = max(state.last_progress, now), None

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._ranks)

    def pids(self) -> list[int]:
        with self._lock:
            return [s.pid for s in self._ranks.values() if s.pid is not None]

    def wait_for_stacks(self, timeout: float) -> None:
        """Wait until every connected rank has answered for its stacks, at most ``timeout`` seconds."""
        with self._lock:
            self.asked.wait_for(lambda: all(s.stacks is not None for s in self._ranks.values()), timeout)

    def verdict(self, hang_timeout: float, stalled: list[int], now: float) -> HangVerdict:
        with self._lock:
            ranks = sorted(self._ranks.values(), key=lambda s: s.rank)
            return HangVerdict(hang_timeout, stalled, [RankProgress(**vars(s)) for s in ranks], now)

    def every_rank(self) -> list[RankProgress]:
        """A copy of each rank's latest state, live or ended (the newest connection's per rank)."""
        with self._lock:
            latest = {**self._ended, **{s.rank: s for s in self._ranks.values()}}
            return [RankProgress(**vars(latest[r])) for r in sorted(latest)]

    def ranks(self) -> set[int]:
        with self._lock:
            return {s.rank for s in self._ranks.values()}

    def live_nodes(self) -> set[int | None]:
        """The nodes of the connected ranks."""
        with self._lock:
            return {s.node for s in self._ranks.values()}
