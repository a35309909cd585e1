"""The hang watchdog's messages on the run channel (see docs/hangs.md).

A rank's watchdog thread (:mod:`~airflow_provider_torchdist.spark.node.watchdog`) sends a
:class:`Progress` every few seconds; when the driver finds the run hung
(:mod:`~airflow_provider_torchdist.spark.driver.hang_watch`) it sends every rank a
:class:`StackRequest`, and each rank that can still answer sends its :class:`Stacks`. They are
kinds of :mod:`.protocol`, which imports this module (its encoder and decoder serve them), checked
field by field like the others. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_provider_torchdist.spark.wire.message import Message, ProtocolError

#: The longest ``where`` a rank sends (``path/to/train.py:42 in train_step``, cut to fit).
WHERE_CHARS = 400
#: The longest name of the torch.distributed function a rank waits in.
WAITS_IN_CHARS = 100
#: The most of a rank's formatted stacks that travels (every thread's; the end is cut).
MAX_STACKS_CHARS = 64 * 1024
#: The largest count a rank sends (events, moves, collectives, samples): far beyond any run's, and
#: it keeps the driver's arithmetic on them (step times, compute shares) within a float.
MAX_COUNT = 2**53

_STR, _INT, _NUMBER = (str,), (int,), (int, float)


def _check_text(kind: str, name: str, value: str | None, most: int) -> None:
    if value is not None and len(value) > most:
        raise ProtocolError(f"{kind!r} message: {name} of {len(value)} characters (at most {most})")


@dataclass(frozen=True)
class Progress(Message):
    """A rank's progress so far, from its watchdog thread every few seconds.

    ``events``: progress events counted since the rank started (``report()``, ``stop_requested()``,
    the Lightning and Hugging Face callbacks' steps); ``moves``: samples of the main thread in which
    its Python position had changed since the sample before; ``event_gap_s``: the mean seconds
    between two events since the last message (None with fewer than two), the step time a
    straggler check compares; ``where``: the main thread's innermost user frame now
    (``file:line in function``); ``waits_in``: the torch.distributed function it is in now, if
    any; ``pid``: the rank's process (the driver ends it by PID only when it is its own child);
    ``collectives``: how many collectives it has issued on its default process group (None before
    it has one): a loop whose time goes to one blocking call still issues them, step after step;
    ``samples`` and ``busy``: how many times the main thread was sampled, and how many of those it
    was not waiting in a torch.distributed call (its compute share, which a straggler check
    compares: in synchronous training every rank's step takes as long as the slowest one's, but
    only the slow one does not wait).
    """

    KIND = "progress"
    SCHEMA = (
        ("events", "e", _INT, False),
        ("moves", "m", _INT, False),
        ("event_gap_s", "gap", _NUMBER, True),
        ("where", "w", _STR, False),
        ("waits_in", "in", _STR, True),
        ("pid", "pid", _INT, False),
        ("collectives", "c", _INT, True),
        ("samples", "s", _INT, True),
        ("busy", "b", _INT, True),
    )
    events: int
    moves: int
    event_gap_s: float | None
    where: str
    waits_in: str | None
    pid: int
    collectives: int | None = None
    samples: int | None = None
    busy: int | None = None

    def check(self) -> None:
        if self.events < 0 or self.moves < 0 or self.pid <= 0 or (self.collectives or 0) < 0:
            raise ProtocolError(
                f"'progress' message: bad counts or pid ({self.events}, {self.moves}, {self.pid})"
            )
        if max(self.events, self.moves, self.collectives or 0, self.samples or 0) > MAX_COUNT:
            raise ProtocolError(f"'progress' message: a count beyond {MAX_COUNT}")
        if not 0 <= (self.busy or 0) <= (self.samples or 0):
            raise ProtocolError(f"'progress' message: bad sample counts ({self.busy} of {self.samples})")
        if self.event_gap_s is not None and not 0 <= self.event_gap_s < 1e9:  # NaN fails this too
            raise ProtocolError(f"'progress' message: bad event gap {self.event_gap_s}")
        _check_text(self.KIND, "where", self.where, WHERE_CHARS)
        _check_text(self.KIND, "waits_in", self.waits_in, WAITS_IN_CHARS)


@dataclass(frozen=True)
class StackRequest(Message):
    """To a rank, from the driver: the run is hung; send every thread's Python stack."""

    KIND = "stacks?"


@dataclass(frozen=True)
class Stacks(Message):
    """A rank's answer to a :class:`StackRequest`: every thread's stack, formatted (``text``), and
    where its main thread is (``where``, ``waits_in`` as in :class:`Progress`). ``nccl_trace``:
    where NCCL's flight recorder was dumped on this rank's host (GPU runs), else None."""

    KIND = "stacks"
    SCHEMA = (
        ("text", "t", _STR, False),
        ("where", "w", _STR, False),
        ("waits_in", "in", _STR, True),
        ("nccl_trace", "nccl", _STR, True),
    )
    text: str
    where: str
    waits_in: str | None = None
    nccl_trace: str | None = None

    def check(self) -> None:
        _check_text(self.KIND, "text", self.text, MAX_STACKS_CHARS)
        _check_text(self.KIND, "where", self.where, WHERE_CHARS)
        _check_text(self.KIND, "waits_in", self.waits_in, WAITS_IN_CHARS)
        _check_text(self.KIND, "nccl_trace", self.nccl_trace, WHERE_CHARS)
