"""What a committed checkpoint says about itself, and the choices made from it: which one a run
resumes, which ones retention keeps, and their order (best first).

A checkpoint is ``<checkpoint_dir>/step-<step, 9 digits>-<run token>/``: its files, then ``manifest.json``,
written last. The manifest is the commit: a reader trusts a step only when its manifest is there and
the files match it (size and SHA-256), so a writer killed mid-checkpoint leaves nothing a reader
loads, on stores without rename too (S3, GCS: one small PUT is atomic). The manifest records the
step, the metrics, the time, the DAG run and task that wrote it, and (set by the task once the
run succeeded) whether that run finished.

Standard library only: pure functions over :class:`Manifest`, which the ranks' store
(:mod:`~airflow_provider_torchdist.spark.node.checkpoint_store`) and the Airflow side (the task's
``checkpoints`` XCom, ``load_checkpoint``) share.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

#: The run's checkpoint directory: a local path, or any fsspec URI (``s3://bucket/prefix``).
CHECKPOINT_ENV = "TORCHDIST_CHECKPOINT_DIR"
#: JSON: who the run is (``run``), ``resume_from``, and the retention settings (:class:`Policy`).
SETTINGS_ENV = "TORCHDIST_CHECKPOINT_SETTINGS"
#: JSON: the DAG run and task that own the run (``dag_id``, ``run_id``, ``task_id``, ``map_index``,
#: ``try_number``), set by the operator; unset when the hook runs outside a task.
RUN_ENV = "TORCHDIST_CHECKPOINT_RUN"
#: JSON: fsspec storage options made from ``checkpoint_conn_id`` (credentials; never logged).
STORAGE_OPTIONS_ENV = "TORCHDIST_CHECKPOINT_STORAGE_OPTIONS"
FORMAT = "torchdist-checkpoint/1"
MANIFEST = "manifest.json"
STATE = "state.pt"
STEP_DIR = re.compile(r"^step-(\d{9})-([0-9a-f]{12}|local)$")
#: A checkpoint's file: a plain name in its step's prefix (no folder, nothing hidden).
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}$")


def checked_file_name(name: Any) -> str:
    """``name`` if it may name a checkpoint's file; ``ValueError`` otherwise (a manifest is read
    from a store every executor can write, and its file names become paths that are read,
    fetched and deleted)."""
    if not isinstance(name, str) or not FILE_NAME.match(name) or name == MANIFEST:
        raise ValueError(
            f"{name!r} cannot name a checkpoint's file: use letters, digits, '_', '.', '-', '=', '+' "
            "(no folders), at most 200 characters, not starting with '.' or '-', not manifest.json"
        )
    return name


def run_token(run: dict[str, Any] | None) -> str:
    """12 hex digits naming one DAG run's task (``local`` outside Airflow): two DAG runs that share a
    ``checkpoint_dir`` never write the same prefix, so a fresh run leaves the other's checkpoints."""
    if not run:
        return "local"
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:12]


def step_dir(step: int, run: dict[str, Any] | None) -> str:
    """``step-000000042-<run token>``: the prefix that holds one step's files and its manifest."""
    return f"step-{int(step):09d}-{run_token(run)}"


@dataclass(frozen=True)
class Policy:
    """Retention: the ``keep_last`` newest plus the ``keep_best`` best by ``metric`` (``mode``
    ``"min"`` or ``"max"``), among the checkpoints of one DAG run's task."""

    keep_last: int = 2
    keep_best: int = 0
    metric: str | None = None
    mode: str = "min"


@dataclass(frozen=True)
class Settings:
    """What the task tells its ranks about checkpoints (``TORCHDIST_CHECKPOINT_SETTINGS``)."""

    run: dict[str, Any] | None = None  # {"dag_id", "run_id", "task_id", "map_index"}; None: no task
    resume_from: str | None = None  # "latest", a checkpoint's URI, or None
    policy: Policy = field(default_factory=Policy)
    try_number: int | None = None

    def to_json(self) -> str:
        """``resume_from`` and the policy (the run's identity travels apart, in ``RUN_ENV``)."""
        return json.dumps({"resume_from": self.resume_from, "policy": asdict(self.policy)}, sort_keys=True)

    @classmethod
    def from_env(cls, environ: Any = None) -> Settings:
        """The settings the task gave the ranks (defaults when it gave none)."""
        env = os.environ if environ is None else environ
        data = json.loads(env.get(SETTINGS_ENV) or "{}")
        run = json.loads(env.get(RUN_ENV) or "null")
        try_number = run.pop("try_number", None) if isinstance(run, dict) else None
        return cls(
            run=run or None,
            resume_from=data.get("resume_from"),
            policy=Policy(**data.get("policy") or {}),
            try_number=try_number,
        )


def run_env(dag_id: str, run_id: str, task_id: str, map_index: int | None, try_number: int | None) -> str:
    """``TORCHDIST_CHECKPOINT_RUN``'s value for one task instance."""
    run = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index}
    return json.dumps({**run, "try_number": try_number}, sort_keys=True)


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint (``step-*/manifest.json``)."""

    step: int
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    run: dict[str, Any] | None = None
    try_number: int | None = None
    finished: bool = False
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"bytes", "sha256"}
    sharded: bool = False  # written by every rank with torch's distributed checkpoint (DCP)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """The manifest ``text`` holds; ``ValueError`` for anything not of its shape (whoever can
        write the store can plant any JSON, and one bad object must not break every reader)."""
        try:
            data = json.loads(text)
        except RecursionError:  # nested deeper than the stack (a planted file, well under its size cap)
            raise ValueError(f"not a {FORMAT} manifest: nested too deep") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        metrics, files = data.get("metrics") or {}, data.get("files") or {}
        if not (
            _is_int(data.get("step"))
            and data["step"] >= 0
            and _is_finite(data.get("time"))
            and isinstance(metrics, dict)
            and all(_is_finite(v) for v in metrics.values())
            and isinstance(data.get("run"), dict | None)
            and (data.get("try_number") is None or _is_int(data["try_number"]))
            and isinstance(data.get("finished", False), bool)
            and isinstance(data.get("sharded", False), bool)
            and isinstance(files, dict)
            and all(isinstance(f, dict) for f in files.values())
            and all(isinstance(n, str) and FILE_NAME.match(n) and n != MANIFEST for n in files)
        ):
            raise ValueError(f"a {FORMAT} manifest of the wrong shape")
        return cls(
            step=data["step"],
            time=float(data["time"]),
            metrics={str(k): float(v) for k, v in metrics.items()},
            run=data.get("run"),
            try_number=data.get("try_number"),
            finished=data.get("finished", False),
            files=dict(files),
            sharded=data.get("sharded", False),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    try:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond any float: JSON puts no bound on its integers
        return False


def clean_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """``metrics`` as ``{name: float}``; a value that is no finite number is refused by name."""
    cleaned: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        try:
            number = float(value)  # a 0-d tensor or a numpy scalar converts too
        except (TypeError, ValueError):
            raise TypeError(f"metrics[{name!r}] must be a number, got {type(value).__name__}") from None
        if not math.isfinite(number):
            raise ValueError(f"metrics[{name!r}] is {number}: a checkpoint's metric must be finite")
        cleaned[str(name)] = number
    return cleaned


def describe_run(run: dict[str, Any] | None) -> str:
    """``DAG run 'r1' of dag/task`` for the log, or ``a run outside Airflow``."""
    if not run:
        return "a run outside Airflow (no DAG run recorded)"
    task = run.get("task_id")
    if run.get("map_index") not in (None, -1):
        task = f"{task}[{run['map_index']}]"
    return f"DAG run {run.get('run_id')!r} of {run.get('dag_id')}.{task}"


def newest(manifests: list[Manifest]) -> Manifest | None:
    """The newest checkpoint of several runs: written last (by its host's clock), then the highest step."""
    return max(manifests, key=lambda m: (m.time, m.step), default=None)


def furthest(manifests: list[Manifest]) -> Manifest | None:
    """The newest checkpoint of one run: the highest step (its tries may run on hosts whose clocks
    differ, but each resumes where the last one stopped, so its steps only grow)."""
    return max(manifests, key=_progress, default=None)


def _progress(manifest: Manifest) -> tuple[int, float]:
    return manifest.step, manifest.time


def own(manifests: list[Manifest], run: dict[str, Any] | None) -> list[Manifest]:
    """The checkpoints written by ``run`` (the same DAG run and task; any try)."""
    return [m for m in manifests if (m.run or None) == (run or None)]


def choose_resume(manifests: list[Manifest], settings: Settings, where: str) -> tuple[Manifest | None, str]:
    """The checkpoint this run resumes from (None: start fresh), and why, for the log.

    A run resumes its own checkpoints (an earlier try or a torchrun restart of the same DAG run's
    task), the newest. Another DAG run's are never resumed silently: only ``resume_from="latest"``
    (the newest in ``where``, whoever wrote it) takes them. A run outside Airflow (the hook used
    directly) has no DAG run, and resumes the newest that no DAG run wrote.
    """
    if settings.resume_from == "latest":
        chosen = newest(manifests)
        if chosen is None:
            return None, f"starting fresh: resume_from='latest', but {where} holds no committed checkpoint"
        return chosen, (
            f"resuming from step {chosen.step} (resume_from='latest'), written by {describe_run(chosen.run)}"
        )
    mine = furthest(own(manifests, settings.run))
    if mine is not None:
        return mine, (
            f"resuming from step {mine.step}, written by an earlier try or restart of this task "
            f"({describe_run(mine.run)})"
        )
    others = newest(manifests)
    if others is None:
        return None, f"starting fresh: no committed checkpoint in {where}"
    state = "which finished" if others.finished else "which did not finish"
    return None, (
        f"starting fresh (step 0): {where} holds {len(manifests)} checkpoint(s) of other runs, the "
        f"newest step {others.step} from {describe_run(others.run)}, {state}; a new DAG run does "
        "not resume another's. Pass resume_from='latest' (or one checkpoint's URI) to resume from it."
    )


def _metric_key(manifest: Manifest, policy: Policy) -> float:
    value = manifest.metrics[policy.metric]  # type: ignore[index]
    return value if policy.mode == "min" else -value


def best_first(manifests: list[Manifest], policy: Policy) -> list[Manifest]:
    """Best first by ``policy.metric`` (those without it after), then the highest step first."""
    by_step = sorted(manifests, key=_progress, reverse=True)
    if not policy.metric:
        return by_step
    scored = [m for m in by_step if policy.metric in m.metrics]
    scored.sort(key=lambda m: _metric_key(m, policy))  # stable: ties stay newest first
    return scored + [m for m in by_step if policy.metric not in m.metrics]


def to_keep(manifests: list[Manifest], policy: Policy) -> list[Manifest]:
    """What retention keeps of one run's checkpoints: the ``keep_last`` newest (highest steps) and
    the ``keep_best`` best by the metric (a checkpoint without the metric is never among the best)."""
    by_step = sorted(manifests, key=_progress, reverse=True)
    kept = {m.step for m in by_step[: max(policy.keep_last, 0)]}
    if policy.metric and policy.keep_best > 0:
        scored = [m for m in best_first(manifests, policy) if policy.metric in m.metrics]
        kept |= {m.step for m in scored[: policy.keep_best]}
    return [m for m in by_step if m.step in kept]
