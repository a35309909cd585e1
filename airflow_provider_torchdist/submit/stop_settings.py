"""Checks of the stop settings, ``stop_grace_period`` and ``stop_signal`` (see the run lifetime's
graceful stops), shared by the operator and the hook like the other checks (:mod:`.validation`)."""

from __future__ import annotations

import math
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.submit.validation import ASCII_NUMBER

#: The longest ``stop_grace_period`` (an hour): a stop that waits longer holds the task's retry
#: and the cluster's slots; a run that needs more checkpoints too rarely.
MAX_GRACE_S = 3600
#: The shortest ``hang_timeout``: ranks report their progress every 2 s, so a shorter one would
#: turn a few late reports into a hang.
MIN_HANG_TIMEOUT_S = 10
#: The longest ``hang_timeout`` (a week): past it, a typo rather than a choice.
MAX_HANG_TIMEOUT_S = 7 * 24 * 3600
#: The signals a stopped run's ranks may be sent: those a training process can catch and that end
#: it by default. SIGKILL and SIGSTOP cannot be caught; fault signals (SIGSEGV, ...) must not be faked.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def check_grace_period(value: Any, field: str) -> float:
    """Seconds a stopped run's ranks get to checkpoint: a finite number >= 0, at most an hour."""
    if isinstance(value, str) and ASCII_NUMBER.fullmatch(value.strip()):
        value = float(value.strip())
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidTrainingConfig(
            f"{field} must be a finite number of seconds >= 0 (0: no grace, the run is killed at once), "
            f"got {value!r}"
        )
    if value > MAX_GRACE_S:
        raise InvalidTrainingConfig(
            f"{field} must be at most {MAX_GRACE_S} seconds (an hour), got {value!r}: a stop that waits "
            "longer holds the task's retry and the cluster's slots. Checkpoint more often instead."
        )
    return float(value)


def check_stop_signal(value: Any, field: str) -> str:
    """A signal the ranks can catch, by name: ``"SIGTERM"``, ``"term"`` and ``"USR1"`` all count."""
    name = value.strip().upper() if isinstance(value, str) else None
    if name and not name.startswith("SIG"):
        name = "SIG" + name
    if name not in STOP_SIGNALS:
        raise InvalidTrainingConfig(f"{field} must be one of {', '.join(STOP_SIGNALS)}, got {value!r}")
    return name


def check_hang_timeout(value: Any, field: str) -> float | None:
    """Seconds without progress before a run counts as hung: a number from
    :data:`MIN_HANG_TIMEOUT_S` to a week, or None or 0 (no hang watchdog)."""
    if isinstance(value, str) and ASCII_NUMBER.fullmatch(value.strip()):
        value = float(value.strip())
    if isinstance(value, str) and value.strip().lower() in ("none", ""):
        value = None  # a template that rendered None
    if value is None or (not isinstance(value, bool) and value == 0):
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not MIN_HANG_TIMEOUT_S <= value <= MAX_HANG_TIMEOUT_S
    ):
        raise InvalidTrainingConfig(
            f"{field} must be a number of seconds from {MIN_HANG_TIMEOUT_S} to {MAX_HANG_TIMEOUT_S} (a "
            f"week), or None or 0 to turn the hang watchdog off, got {value!r}: ranks report their "
            "progress every 2 s, so a shorter timeout would take a few late reports for a hang"
        )
    return float(value)
