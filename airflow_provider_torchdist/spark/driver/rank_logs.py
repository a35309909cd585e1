"""``log_ranks``: which global ranks' output reaches the task log (torchrun's
``--local-ranks-filter``, but by global rank).

A filtered rank's lines go to a per-run file in the driver's staging directory instead
(``ranks.log``, 0600; it goes with the staging directory when the run ends), and its last lines are kept in
memory: when that rank fails they are printed after all, with its traceback (which reaches the
error either way). ``report()`` lines and the agents' and driver's own lines are never filtered.
Standard library only: it runs in the driver.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

#: The file filtered ranks' lines go to, in the driver's staging directory.
RANKS_LOG = "ranks.log"
#: How many of a filtered rank's last lines are shown when it fails.
TAIL_LINES = 20


def rank_filter(log_ranks: str | list[int], staging_dir: Path) -> RankLogFilter | None:
    """The filter for a job's ``log_ranks`` (``"all"``: none)."""
    return None if log_ranks == "all" else RankLogFilter(list(log_ranks), staging_dir)


class RankLogFilter:
    """``log_ranks`` applied to the run channel's lines. ``shown``: the global ranks shown, or
    None for all of them."""

    def __init__(self, shown: list[int] | None, staging_dir: Path) -> None:
        self.shown = None if shown is None else frozenset(shown)
        self.path = Path(staging_dir) / RANKS_LOG
        self._tails: dict[int, deque[str]] = {}
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self._file = None

    def announcement(self) -> str:
        shown = ", ".join(map(str, sorted(self.shown or ()))) or "none"
        return (
            f"log_ranks: only rank(s) {shown} shown here; the other ranks' output goes to {self.path} "
            "(kept with the run's staging directory), and a failing rank's last lines show here"
        )

    def shows(self, rank: int) -> bool:
        return self.shown is None or rank in self.shown or rank in self._failed

    def hold(self, rank: int, line: str) -> bool:
        """Keep ``line`` of a rank not shown (to the file and its tail) and say so; False: show it.
        Decided under the lock, so that a line cannot slip into a tail after its rank failed."""
        with self._lock:
            if self.shows(rank):
                return False
            self._tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(line)
            if self._file is None:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._file = os.fdopen(fd, "a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
            return True

    def failed(self, rank: int) -> list[str]:
        """``rank`` failed: its last lines not shown yet (once), and from now on all its lines
        are shown (the traceback it prints as it dies among them)."""
        with self._lock:
            self._failed.add(rank)
            return list(self._tails.pop(rank, ()))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
