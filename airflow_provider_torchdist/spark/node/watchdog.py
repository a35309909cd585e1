"""A rank's hang watchdog: a daemon thread that tells the driver whether the rank makes progress.

No user code is needed. Every :data:`SAMPLE_EVERY_S` the thread looks at where the rank's main
thread is in the Python code (``sys._current_frames()``: in-process, no ptrace, works in any
container) and counts a *move* when that changed since the sample before; every
:data:`PROGRESS_EVERY_S` it sends the driver a
:class:`~airflow_provider_torchdist.spark.wire.watchdog_messages.Progress`: the moves, the progress
events of :mod:`.progress` (``report()``, ``stop_requested()``, the callbacks' steps), the mean gap
between events, where the main thread is, and how many collectives it has issued (a loop whose
time goes to one blocking line looks still to the sampler, but issues its collectives step after
step). A main thread blocked in a collective, a sleep or a lock stays in one place and issues
nothing; one that trains moves between samples.

When the driver finds the run hung it asks every rank for its stacks: the thread that reads the
driver's messages answers with every thread's stack. Both threads run while the main thread is
blocked in a torch collective (torch releases the GIL there); a SIGSTOPped rank's threads are
frozen with it, so it sends nothing and answers nothing: the driver names it as silent.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

from airflow_provider_torchdist.spark.node import progress
from airflow_provider_torchdist.spark.wire.private_files import private_directory, write_private_bytes
from airflow_provider_torchdist.spark.wire.watchdog_messages import (
    MAX_STACKS_CHARS,
    WAITS_IN_CHARS,
    WHERE_CHARS,
    Progress,
    Stacks,
)

#: How often the main thread's position is sampled.
SAMPLE_EVERY_S = 0.5
#: How often a rank sends its progress (a message of under 200 bytes).
PROGRESS_EVERY_S = 2.0
#: Where GPU runs' ranks dump NCCL's flight recorder (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, set by the
#: launcher); the rank number is appended, as torch does.
NCCL_TRACE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
#: The node's private directory of those dumps: kept after the run, removed by the next one on that
#: host once this agent is gone (:func:`~airflow_provider_torchdist.spark.wire.private_files.private_directory`).
NCCL_TRACE_DIR_PREFIX = "torchdist-nccl-trace-"

# This package and rank.py as code objects name them: the path they were imported from (relative
# when spark-submit ships the package as ``--py-files``: ``./torchdist_spark.zip/...``), and that
# path made absolute.
_HERE = (__file__, os.path.abspath(__file__))
_PACKAGE_PREFIXES = tuple(
    {os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(f))), "") for f in _HERE}
)
_RANK_FILES = frozenset(os.path.join(os.path.dirname(f), "rank.py") for f in _HERE)
#: Directories whose code is not the user's: the standard library, installed packages, this package.
_LIBRARY_DIRS = tuple(
    {
        os.path.join(p, "")
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    | set(_PACKAGE_PREFIXES)
)
_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_ELASTIC = f"{_DISTRIBUTED}elastic{os.sep}"

Frame = tuple[str, int, str]  # (file, line, function)


def frames_of(frame: FrameType | None) -> list[Frame]:
    """A thread's stack, outermost first, as ``(file, line, function)``."""
    out: list[Frame] = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    out.reverse()
    return out


def users_part(stack: list[Frame]) -> list[Frame]:
    """The frames the rank's work runs in: those above the runtime's call of the user's code
    (``rank.call_entry``), without torchrun's own (``torch/distributed/elastic``)."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] in _RANK_FILES and stack[i][2] == "call_entry":
            return stack[i + 1 :]
    return [f for f in stack if _ELASTIC not in f[0]]


def position(stack: list[Frame]) -> tuple[str, str | None]:
    """Where a main thread is: its innermost frame of user code (``file:line in function``; the
    innermost frame at all when none is the user's), and the torch.distributed function it waits
    in (None when it is not in one)."""
    work = users_part(stack)
    user = [f for f in work if not f[0].startswith(_LIBRARY_DIRS) and not f[0].startswith("<")]
    file, line, name = (user or work or stack or [("?", 0, "?")])[-1]
    where = f"{file}:{line} in {name}"
    waits = [f for f in work if _DISTRIBUTED in f[0] and f[2] not in ("wrapper", "<module>")]
    waits_in = waits[-1][2][:WAITS_IN_CHARS] if waits else None
    return where[-WHERE_CHARS:], waits_in


def _runtime_only(stack: traceback.StackSummary) -> bool:
    """A thread of this provider's runtime: its frames are this package's and the standard library's."""
    files = [f.filename for f in stack]
    return any(f.startswith(_PACKAGE_PREFIXES) for f in files) and all(
        f.startswith(_LIBRARY_DIRS) for f in files
    )


def format_stacks(frames: dict[int, FrameType], main_ident: int | None) -> str:
    """Every thread's stack as Python prints a traceback, the main thread's first and from the
    user's code on (the runtime's frames below it are the same in every rank)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: ident != main_ident)
    parts, runtime = [], 0
    for ident in order:
        stack = traceback.extract_stack(frames[ident])
        if ident != main_ident and _runtime_only(stack):
            runtime += 1  # this provider's own threads (output capture, the watchdog): not the user's
            continue
        label = f"thread {names.get(ident, '?')!r}"
        if ident == main_ident:
            frames_in = users_part([(f.filename, f.lineno or 0, f.name) for f in stack])
            stack = traceback.StackSummary.from_list(stack[len(stack) - len(frames_in) :] or stack)
            label = "main thread"
        lines = "".join(stack.format()).splitlines()
        parts.append(
            "\n".join([f"{label} ({ident}), most recent call last:", *(x for x in lines if x.strip())])
        )
    if runtime:
        parts.append(
            f"({runtime} more thread(s) of the provider's own: output capture, this watchdog, the channel, the group keeper)"
        )
    text = "\n".join(parts)
    if len(text) > MAX_STACKS_CHARS:
        text = text[: MAX_STACKS_CHARS - 40] + "\n... (cut: more stacks than fit)"
    return text


def nccl_flight_recorder(use_gpu: bool, hang_timeout: float | None) -> dict[str, str]:
    """The environment that turns NCCL's flight recorder on for a GPU run's ranks (with the hang
    watchdog on): a trace buffer, a dump when NCCL's own timeout fires, and where dumps go. What the
    cluster set already stays."""
    if not (use_gpu and hang_timeout):
        return {}
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        NCCL_TRACE_ENV: os.path.join(private_directory(NCCL_TRACE_DIR_PREFIX), "nccl_trace_rank_"),
    }
    return {name: value for name, value in env.items() if name not in os.environ}


def dump_nccl_trace() -> str | None:
    """Dump NCCL's flight recorder where :data:`NCCL_TRACE_ENV` says (GPU runs using NCCL); the
    path, or None when there is nothing to dump."""
    prefix = os.environ.get(NCCL_TRACE_ENV)
    if not prefix or "torch" not in sys.modules:
        return None
    try:
        import torch._C._distributed_c10d as c10d
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return None
        # torch has no public call for an on-demand dump; torch 2.8+ names it _dump_fr_trace (the
        # flight recorder outgrew NCCL), earlier ones _dump_nccl_trace.
        dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace
        data = dump()
        return str(write_private_bytes(f"{prefix}{os.environ.get('RANK', '0')}", data))
    except Exception:  # an older torch, no NCCL: the stacks still go
        return None


def collectives_issued() -> int | None:
    """How many collectives this rank has issued on its default process group (the group's
    sequence number); None before it has one. It reads a counter: safe while the main thread waits
    in a collective."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_initialized():
            return None
        return int(dist.group.WORLD._get_sequence_number_for_group())
    except Exception:  # a torch without it, a group being destroyed: the other signals remain
        return None


class RankWatchdog:
    """The watchdog thread of one rank (see the module docstring). ``send`` sends a message to
    the driver and says whether it went; the thread ends when it did not, or at :meth:`stop`.

    Example::

        watchdog = RankWatchdog(client.send)
        watchdog.start()
        ...
        client.send(watchdog.stacks())   # when the driver asks
        watchdog.stop()
    """

    def __init__(
        self,
        send: Callable[[Progress], bool],
        sample_every: float = SAMPLE_EVERY_S,
        report_every: float = PROGRESS_EVERY_S,
        main: int | None = None,
    ) -> None:
        """``main``: the thread to watch (default: the main thread, which runs the user's code)."""
        self._send, self._sample_every, self._report_every = send, sample_every, report_every
        self._main = main if main is not None else threading.main_thread().ident
        self._done = threading.Event()
        self._last: tuple[Frame, ...] | None = None
        self.moves = 0
        #: Samples taken, and those in which the main thread was not waiting in torch.distributed.
        self.samples, self.busy = 0, 0
        self._thread = threading.Thread(target=self._run, name="torchdist-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread, with one last progress message: the rank's final counts (its last steps
        may have come after the thread's last message, and its mean step time counts them)."""
        if not self._done.is_set():
            self._done.set()
            self._send(self.progress())

    def _main_frame(self) -> FrameType | None:
        return sys._current_frames().get(self._main) if self._main is not None else None

    def sample(self) -> None:
        """Look once at the main thread: a move when its stack differs from the last sample's."""
        stack = frames_of(self._main_frame())  # one walk: the signature and the position
        now = tuple(stack)
        self.samples += 1
        if position(stack)[1] is None:  # computing (or anything but waiting for the other ranks)
            self.busy += 1
        # Once the user's code returned, the rank only hands over what it made: that is progress.
        if (self._last is not None and now != self._last) or progress.work_done.is_set():
            self.moves += 1
        self._last = now

    def progress(self) -> Progress:
        """This rank's progress message now."""
        events, gap = progress.take()
        where, waits_in = position(frames_of(self._main_frame()))
        return Progress(
            events,
            self.moves,
            gap,
            where,
            waits_in,
            os.getpid(),
            collectives_issued(),
            self.samples,
            self.busy,
        )

    def stacks(self) -> Stacks:
        """The answer to the driver's request for stacks: every thread's, and where the main one is."""
        frames = sys._current_frames()
        where, waits_in = position(frames_of(frames.get(self._main) if self._main else None))
        return Stacks(format_stacks(frames, self._main), where, waits_in, dump_nccl_trace())

    def _run(self) -> None:
        sent = float("-inf")
        while True:
            self.sample()
            if time.monotonic() - sent >= self._report_every:
                if not self._send(self.progress()):
                    return  # the channel broke: the driver then hears nothing, and says so
                sent = time.monotonic()
            if self._done.wait(self._sample_every):
                return
