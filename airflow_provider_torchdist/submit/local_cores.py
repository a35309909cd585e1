"""More ranks on this machine than it has cores: a warning, once, saying what to do.

Where every rank runs on the Airflow worker (``local_mode=True``: the Spark driver; the embedded
``local[N]`` master, or a ``local[N]`` connection: its executors), ``num_processes`` above the
worker's usable cores makes the ranks time-share them: nothing fails, every step is slower, and
the user is never told. This says so once per process: when the DAG file is parsed if the values
are literal (``local_mode=True``: a DAG warning in the UI, and in the task log when the worker
parses the file), else when the task starts (the embedded master is known only once the
connection is looked up), in the task log.

Example::

    oversubscription(6, 2, LOCAL_MODE)
    # 'num_processes=6 on a 2-core machine: local_mode=True runs every rank on this Airflow worker ...'
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

import airflow

from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.connection import SparkTarget

#: Why the ranks share this machine, by the setting that puts them there.
LOCAL_MODE = "local_mode=True runs every rank on this Airflow worker (the Spark driver)"
LOCAL_MASTER = "the Spark master {master} runs every rank on this Airflow worker"

#: The warnings given in this process: the parse of the DAG file and the task's run share it.
_given: set[str] = set()


class RanksShareCores(UserWarning):
    """``num_processes`` is more than the cores of the machine every rank runs on."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscription(num_processes: int, cores: int, why_here: str) -> str | None:
    """The warning for ``num_processes`` ranks on ``cores`` cores, or None when they fit."""
    if num_processes <= cores:
        return None
    return (
        f"num_processes={num_processes} on a {cores}-core machine: {why_here}, so the {num_processes} "
        f"ranks will time-share {cores} cores, each step slower than with one core per rank. Use "
        f"num_processes<={cores} here, or train on a cluster (a Spark connection, local_mode=False)."
    )


def warn_once(message: str | None, warn: Callable[[str], Any]) -> bool:
    """Give ``message`` through ``warn`` unless this process gave it already; True when given."""
    if message is None or message in _given:
        return False
    _given.add(message)
    warn(message)
    return True


def warn_at_parse(local_mode: Any, num_processes: Any) -> None:
    """The operator's constructor: literal ``local_mode=True`` with a literal ``num_processes``
    (templates and elastic ranges are the run's to check)."""
    if local_mode is True and isinstance(num_processes, int) and not isinstance(num_processes, bool):
        message = oversubscription(num_processes, usable_cores(), LOCAL_MODE)
        warn_once(message, lambda text: warnings.warn(text, RanksShareCores, stacklevel=_dag_file_level()))


def _dag_file_level() -> int:
    """The ``stacklevel`` of the first caller outside this package and Airflow: the DAG file's
    line, as the warning's place (how many of our and Airflow's frames lie between varies)."""
    ours = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(airflow.__file__))
    here = inspect.currentframe()
    frame, level = here.f_back if here else None, 1  # level 1: the frame that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def warn_at_run(spec: TrainingSpec, target: SparkTarget, log: Any) -> None:
    """Before the run starts: every rank on this machine (local mode, or a ``local[N]`` master,
    the embedded one included), more of them than its cores."""
    if spec.local_mode:
        why_here = LOCAL_MODE
    elif target.embedded or target.is_local:
        why_here = LOCAL_MASTER.format(master=target.master)
    else:
        return
    warn_once(oversubscription(spec.max_processes, usable_cores(), why_here), log.warning)
