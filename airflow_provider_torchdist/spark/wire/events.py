"""Timestamped phase events: where a launch's time goes, told by the code itself.

``emit(phase, **fields)`` appends one JSON line to the file named by the environment variable
``TORCHDIST_EVENT_LOG``, and does nothing when it is unset (the variable is read once per process,
so an unset ``emit`` costs one function call and a comparison). The hook, the driver, each node's
barrier task and agent, and each rank emit them; ``bench/`` sets the variable and reads the file
instead of patching the package. Every process of a run on the embedded master inherits the
variable from the hook (spark-submit's environment is the hook's; Spark's Python workers and the
ranks inherit it in turn); an executor started by a cluster's Worker does not, unless it is passed
on with ``spark.executorEnv.TORCHDIST_EVENT_LOG``.

A line is ``{"t": time.time(), "phase": ..., "pid": ..., "role": ..., **fields}``. It is written with
a single ``write`` on a descriptor opened ``O_APPEND``, so lines from many processes interleave
whole. Standard library only: it runs on the cluster, in every rank.

The other benchmarking knob the cluster side reads lives here too: ``TORCHDIST_FAST_START_OFF``
(:func:`fast_start_off`), which switches single start-up accelerations off for ``bench/launch.py``.

Example::

    TORCHDIST_EVENT_LOG=/tmp/run.jsonl python my_dag_task.py
    # {"t": 1718000000.1, "phase": "driver_start", "pid": 4242, "role": "driver"}
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

#: The environment variable that switches events on: the path of the file they are appended to.
EVENT_LOG_ENV = "TORCHDIST_EVENT_LOG"

#: Every phase the package emits, in launch order: ``phase -> (role, what it marks)``. The role says
#: which process emits it: ``hook`` (the Airflow side), ``driver`` (the Spark application),
#: ``node`` (one torchrun node: a barrier task, or the driver in local mode) or ``rank``.
PHASES: dict[str, tuple[str, str]] = {
    "hook_start": ("hook", "hook.run: settings resolved, checks and staging begin"),
    "staged": ("hook", "the run is staged: payload pickled, spec and py-files written"),
    "supervisor_start": ("hook", "start_run: the run's detached supervisor is started"),
    "supervisor_listening": ("hook", "the supervisor's lifeline listens; the task connects as owner"),
    "spark_submit_start": ("hook", "spark-submit is started (through SparkSubmitHook.submit)"),
    "driver_start": ("driver", "the driver application's main(): interpreter up, package imported"),
    "spark_context_start": ("driver", "pyspark imported; SparkContext.getOrCreate begins"),
    "spark_context_up": ("driver", "the SparkContext is up"),
    "barrier_stage_submitted": ("driver", "the barrier stage's collect() begins"),
    "elastic_stage_submitted": ("driver", "an elastic run's stage: its collect() begins"),
    "task_start": ("node", "a barrier task starts in a Spark Python worker (field: node)"),
    "launcher_imported": ("node", "the launcher (torch) is imported (field: node)"),
    "rendezvous_done": ("node", "the node knows task 0's rendezvous endpoint (field: node)"),
    "agent_start": ("node", "torchrun's agent starts for this node (field: node)"),
    "rank_start": ("rank", "the rank calls the training function or script (field: rank)"),
    "rank_returned": ("rank", "the training function returned (field: rank)"),
    "output_sent": ("rank", "rank 0's value is with the driver (field: rank)"),
    "rank_end": ("rank", "the rank is done: output capture stopped, channel closed (field: rank)"),
    "agent_end": ("node", "the agent has reaped its ranks and returns (field: node)"),
    "task_end": ("node", "the barrier task returns its result (field: node)"),
    "barrier_stage_done": ("driver", "collect() returned"),
    "elastic_stage_done": ("driver", "an elastic run's collect() returned"),
    "rendezvous_closed": ("node", "an elastic run's late node found the run finished (field: node)"),
    "channel_close": ("driver", "the run channel starts closing"),
    "channel_closed": ("driver", "the run channel is closed"),
    "spark_stop": ("driver", "SparkContext.stop begins"),
    "spark_stopped": ("driver", "SparkContext.stop returned"),
    "driver_exit": ("driver", "the outcome is written; the driver exits (field: code)"),
    "spark_submit_end": ("hook", "spark-submit has exited"),
    "outcome_read": ("hook", "the follower has stopped and the outcome is read"),
    "session_ended": ("hook", "what was left of spark-submit's session is ended"),
}

_UNREAD = object()
_path: Any = _UNREAD


def _log_path() -> str | None:
    global _path
    if _path is _UNREAD:
        _path = os.environ.get(EVENT_LOG_ENV) or None
    return _path


def emit(phase: str, **fields: Any) -> None:
    """Append one event line when ``TORCHDIST_EVENT_LOG`` is set; never raises."""
    path = _log_path()
    if path is None:
        return
    role = PHASES.get(phase, ("?", ""))[0]
    record = {"t": time.time(), "phase": phase, "pid": os.getpid(), "role": role, **fields}
    try:
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except (OSError, ValueError, TypeError):
        return  # an event is never worth failing a run for


#: A benchmarking knob, not a setting: ``TORCHDIST_FAST_START_OFF=jvm`` (or ``all``) switches the
#: start-up acceleration off in a run that has ``fast_jvm_start`` on (see ``fast_start.py``).
FAST_START_OFF_ENV = "TORCHDIST_FAST_START_OFF"
FAST_START_PARTS = ("jvm", "pyspark", "torch")


def fast_start_off(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The start-up accelerations ``TORCHDIST_FAST_START_OFF`` switches off (``all``: every one).

    Example: ``TORCHDIST_FAST_START_OFF=jvm`` gives ``frozenset({"jvm"})``.
    """
    value = (os.environ if environ is None else environ).get(FAST_START_OFF_ENV, "")
    parts = {p.strip() for p in value.split(",") if p.strip()}
    return frozenset(FAST_START_PARTS) if "all" in parts else frozenset(parts)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events in ``path``, in the order they were written (a torn last line is skipped)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events
