"""What the Training view shows of one task instance: :func:`training_figures`, a pure function of
the task's state, its ``report()`` history and its world size, as the JSON endpoint answers it.

Example::

    training_figures(
        "running",
        [{"rank": 0, "step": 0, "time": 100.0, "total_steps": 10, "loss": 0.9},
         {"rank": 0, "step": 3, "time": 106.0, "total_steps": 10, "loss": 0.4}],
        world_size=2,
        source="live",
    )
    # {"state": "running", "source": "live", "world_size": 2,
    #  "metrics": [{"step": 0, "time": 100.0, "loss": 0.9}, {"step": 3, "time": 106.0, "loss": 0.4}],
    #  "progress": {"step": 3, "total_steps": 10, "fraction": 0.4, "eta_seconds": 12.0}}

The steps are counted from 0, as ``for step in range(total_steps)`` reports them: the record of
step 3 says 4 of 10 steps are done. The ETA is the time per step so far (from the first record to
the latest, both with ``total_steps``) times the steps left.
"""

from __future__ import annotations

import math
from typing import Any

from airflow_provider_torchdist.spark.driver.stragglers import COMPUTE_SHARE, MEAN_STEP_TIME, is_rank_summary
from airflow_provider_torchdist.spark.node.metrics import RECORD_FIELDS

#: Task instance states after which nothing more is reported: the view stops refreshing.
FINISHED_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")


def _json_number(value: Any) -> float | int | None:
    """A metric value the JSON answer can carry: NaN and infinities (report() keeps them) as null."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an int beyond any float (a rank's record puts no bound on them)
        return None


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def charted_records(history: list[Any]) -> list[dict[str, Any]]:
    """The records of the rank the view charts: rank 0's, or the lowest reporting rank's when rank 0
    reported nothing (``report(all_ranks=True)`` from other ranks only); anything but a record is
    left out."""
    records = [r for r in history if isinstance(r, dict)]
    ranks = sorted({r.get("rank") for r in records if _is_step(r.get("rank"))})
    if not ranks:
        return records
    return [r for r in records if r.get("rank") == ranks[0]]


def metric_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"step", "time", <metric>: value, ...}`` per record: the record's own fields but the step
    and time left out, values JSON-safe."""
    points = []
    for record in records:
        point: dict[str, Any] = {
            "step": record.get("step") if _is_step(record.get("step")) else None,
            "time": _json_number(record.get("time")),
        }
        for name, value in record.items():
            if name not in RECORD_FIELDS and isinstance(name, str):
                point[name] = _json_number(value)
        points.append(point)
    return points


def progress(records: list[dict[str, Any]], state: str | None) -> dict[str, Any]:
    """``{"step", "total_steps", "fraction", "eta_seconds"}`` from the latest record that gives
    ``total_steps``; without one, only the latest step is known (the others are null)."""
    latest_step = next((r["step"] for r in reversed(records) if _is_step(r.get("step"))), None)
    counted = [
        r
        for r in records
        if _is_step(r.get("total_steps")) and r["total_steps"] > 0 and _is_step(r.get("step"))
    ]
    if not counted:
        return {"step": latest_step, "total_steps": None, "fraction": None, "eta_seconds": None}
    last = counted[-1]
    total, step = last["total_steps"], last["step"]
    done = min(max(step + 1, 0), total)
    return {
        "step": step,
        "total_steps": total,
        "fraction": round(done / total, 4),
        "eta_seconds": _eta(counted, done, total, state),
    }


def _eta(counted: list[dict[str, Any]], done: int, total: int, state: str | None) -> float | None:
    if state == "success" or done >= total:
        return 0.0
    if state in FINISHED_STATES:
        return None  # failed or skipped: nothing is coming
    timed = [r for r in counted if _json_number(r.get("time")) is not None]
    if len(timed) < 2:
        return None
    first, last = timed[0], timed[-1]
    steps, seconds = last["step"] - first["step"], last["time"] - first["time"]
    if steps <= 0 or seconds < 0:
        return None
    return round((total - done) * seconds / steps, 1)


def training_figures(
    state: str | None,
    history: list[Any],
    world_size: int | None,
    source: str | None,
    step_times: Any = None,
) -> dict[str, Any]:
    """The JSON endpoint's answer for one task instance (see the module docstring); ``source`` says
    where ``history`` came from: ``"live"`` (the run's supervisor) or ``"xcom"``. ``step_times``:
    XCom ``rank_step_times`` (a live history carries them itself, at its end)."""
    reports = [r for r in history if not is_rank_summary(r)]
    records = charted_records(reports)
    figures = {
        "state": state,
        "source": source,
        "world_size": world_size,
        "metrics": metric_points(records),
        "progress": progress(records, state),
    }
    ranks = rank_step_times(history) or rank_step_times(step_times if isinstance(step_times, list) else [])
    return {**figures, "ranks": ranks} if ranks else figures


def rank_step_times(history: list[Any]) -> list[dict[str, Any]]:
    """Each rank's mean step time, steps per second and compute share, from the records the driver
    adds at the end of a run (:func:`~airflow_provider_torchdist.spark.driver.stragglers.step_time_records`),
    by rank (the latest per rank)."""
    found: dict[int, dict[str, Any]] = {}
    for record in history:
        if not is_rank_summary(record) or not _is_step(record.get("rank")):
            continue
        mean = _json_number(record.get(MEAN_STEP_TIME))
        found[record["rank"]] = {
            "rank": record["rank"],
            MEAN_STEP_TIME: mean,
            "steps_per_s": _json_number(round(1 / mean, 3)) if mean else None,  # 1 / 5e-324 is inf
            COMPUTE_SHARE: _json_number(record.get(COMPUTE_SHARE)),
        }
    return [found[rank] for rank in sorted(found)]


def checkpoint_marks(entries: Any) -> list[dict[str, Any]]:
    """The kept checkpoints (the training task's XCom ``checkpoints``, best first) as the view marks
    them on the curves: ``{"step", "best", "metrics"}`` each, the first one ``best``; anything of
    another shape is left out (XCom is written by the task, but read here by every viewer)."""
    marks: list[dict[str, Any]] = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not _is_step(entry.get("step")):
            continue
        metrics = entry.get("metrics") if isinstance(entry.get("metrics"), dict) else {}
        numbers = {str(k): _json_number(v) for k, v in metrics.items()}
        marks.append({"step": entry["step"], "best": not marks, "metrics": numbers})
    return marks
