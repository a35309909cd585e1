"""The world size over an elastic run: one entry at the start and one per change, each with its reason.

Rank 0 of every new worker group says how many ranks the group has (``WorldSize`` on the run
channel); the driver's executor watch says when Spark lost a node. This module turns the two into
the history that the hook returns as ``world_sizes`` and the task log tells as it happens.
Socket-free and thread-safe; standard library only.

Example::

    history = WorldSizeHistory(say=print)
    history.generation(2)            # 0: "world size 2 (start)"
    history.node_lost("10.0.0.12")
    history.generation(1)            # 1: "world size 2 -> 1 (lost the node on 10.0.0.12)"
    history.entries                  # [{"time": ..., "world_size": 2, "reason": "start"}, ...]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class WorldSizeHistory:
    """Generations of an elastic run and the world size each one trained with."""

    def __init__(self, say: Callable[[str], None] = lambda _: None) -> None:
        self._say = say
        self._lock = threading.Lock()
        #: ``{"time": epoch seconds, "world_size": n, "reason": why}``: the start, then each change.
        self.entries: list[dict[str, Any]] = []
        #: Every loss the driver saw: ``(epoch seconds, host)``.
        self.losses: list[tuple[float, str]] = []
        self._pending: list[str] = []
        #: The entry of a decrease recorded before any loss explained it.
        self._unexplained: int | None = None
        self._generations = 0

    def node_lost(
        self, host: str, at: float | None = None, decommissioned: bool = False, hung: bool = False
    ) -> None:
        """Spark lost the executor on ``host`` (or ``decommissioned`` it, and its node left after the
        ranks' checkpoint; or its node ``hung`` and was made to leave): the reason of the next
        decrease, or of the one just recorded without a reason (the survivors may meet again before
        Spark notices the loss)."""
        at = time.time() if at is None else at
        reason = f"the node on {host} was decommissioned" if decommissioned else f"lost the node on {host}"
        reason = f"the node on {host} hung" if hung else reason
        with self._lock:
            self.losses.append((at, host))
            if self._unexplained is not None:
                self.entries[self._unexplained]["reason"] = reason
                self._unexplained = None
            else:
                self._pending.append(reason)
        if hung:
            self._say(
                f"elastic: the node on {host} left at {_clock(at)} (hung: its ranks were killed); the "
                "other ranks restart from the latest checkpoint and meet again without it"
            )
            return
        if decommissioned:
            self._say(
                f"elastic: the node on {host} left at {_clock(at)} (decommissioned); the other ranks "
                "restart from the checkpoint they just wrote and meet again without it"
            )
            return
        self._say(
            f"elastic: Spark lost the executor on {host} at {_clock(at)}; the surviving ranks restart "
            "from the latest checkpoint and meet again without it"
        )

    def generation(self, world_size: int, at: float | None = None) -> int:
        """A worker group of ``world_size`` ranks started; returns its number (0, 1, ...)."""
        at = time.time() if at is None else at
        with self._lock:
            number = self._generations
            self._generations += 1
            before = self.entries[-1]["world_size"] if self.entries else None
            self._unexplained = None
            if before is None:
                reason = "start"
            elif world_size > before:
                reason = "a node joined"
            elif world_size < before:
                reason = "; ".join(self._pending) or "a node left"
                if not self._pending:
                    self._unexplained = len(self.entries)
            else:
                reason = "; ".join(self._pending) or "restart after a failure"
            # A loss explains one change at most: a group that grew, or re-formed at the same
            # size (a replacement joined at once), has taken it in.
            self._pending.clear()
            changed = before != world_size
            if changed:
                self.entries.append({"time": at, "world_size": world_size, "reason": reason})
        if before is None:
            self._say(f"elastic: training starts with world size {world_size}")
        elif changed:
            self._say(f"elastic: world size {before} -> {world_size} ({reason})")
        else:
            self._say(f"elastic: worker group restarted at world size {world_size} ({reason})")
        return number

    def describe_losses(self) -> str:
        """The losses, for an error: ``the node on 10.0.0.12 (lost at 12:00:01)``; empty when none."""
        with self._lock:
            return ", ".join(f"the node on {host} (lost at {_clock(at)})" for at, host in self.losses)


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch)) + " UTC"
