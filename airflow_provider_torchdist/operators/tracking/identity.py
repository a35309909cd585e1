"""What an MLflow run says of its task instance: its tags and params, from the task's context and
the rendered spec (pure functions: tests call them with plain values).

The run is found again by :data:`KEY_TAG`, a digest of the task instance and its clear
generation (Airflow raises ``max_tries`` when a task is cleared): a retry or a durable reattach
finds the same run, a cleared task starts a new one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.masking import SECRET_NAME

#: The tag that names a task instance's run (its generation included): how a retry finds it.
KEY_TAG = "torchdist.task_instance_key"
#: The tag of a mapped task's parent run.
PARENT_KEY_TAG = "torchdist.sweep_key"
#: The time of the newest metric record logged: a new owner skips the history before it.
LOGGED_UNTIL_TAG = "torchdist.metrics_logged_until"
#: MLflow keeps params up to this many characters (its own limit is 6000 in older servers).
MAX_PARAM_CHARS = 6000


@dataclass(frozen=True)
class TaskIdentity:
    """The task instance an MLflow run belongs to."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 1
    max_tries: int = 0
    log_url: str = ""
    map_name: str | None = None

    @property
    def mapped(self) -> bool:
        return self.map_index >= 0

    def key(self) -> str:
        """The digest a retry finds its run by: the same task instance, not cleared since."""
        parts = [self.dag_id, self.run_id, self.task_id, self.map_index, self.max_tries]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]

    def sweep_key(self) -> str:
        """The digest of the mapped task's parent run (shared by every map index)."""
        return hashlib.sha256(json.dumps([self.dag_id, self.run_id, self.task_id]).encode()).hexdigest()[:32]

    def run_name(self) -> str:
        """``map_index_template``'s rendered name for a map index, else ``<task>[<index>]``/``<task>``."""
        if self.mapped:
            return self.map_name or f"{self.task_id}[{self.map_index}]"
        return self.task_id

    def tags(self) -> dict[str, str]:
        """The tags every try sets (``airflow.try_number`` and the log URL follow the latest try)."""
        tags = {
            KEY_TAG: self.key(),
            "airflow.dag_id": self.dag_id,
            "airflow.run_id": self.run_id,
            "airflow.task_id": self.task_id,
            "airflow.map_index": str(self.map_index),
            "airflow.try_number": str(self.try_number),
        }
        if self.log_url:
            tags["airflow.log_url"] = self.log_url
        return tags


def identity_of(context: Mapping[str, Any], map_name: str | None = None) -> TaskIdentity:
    """The identity of the context's task instance."""
    ti = context["ti"]
    max_tries = getattr(ti, "max_tries", 0)
    try:
        log_url = str(getattr(ti, "log_url", "") or "")
    except Exception:  # the URL needs [api] base_url: a run is logged without it
        log_url = ""
    return TaskIdentity(
        dag_id=str(ti.dag_id),
        run_id=str(ti.run_id),
        task_id=str(ti.task_id),
        map_index=int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", -1) is not None else -1),
        try_number=int(getattr(ti, "try_number", 1) or 1),
        max_tries=max_tries if type(max_tries) is int else 0,
        log_url=log_url,
        map_name=map_name,
    )


def flatten(value: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """``(name, text)`` pairs of a nested value: ``{"a": {"b": 1}}`` under ``kwargs`` gives ``kwargs.a.b``."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}")
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=repr)
        yield prefix, text[:MAX_PARAM_CHARS]


def run_params(spec: TrainingSpec, args: Any, kwargs: Any) -> dict[str, str]:
    """The params of a run: ``args.<i>``, ``kwargs.<name>`` (nested dicts dotted), the topology,
    ``train_data``'s query or table, and ``conf.<key>`` less anything that looks secret."""
    params: dict[str, str] = {}
    for i, arg in enumerate(args or ()):
        params |= dict(flatten(arg, f"args.{i}"))
    params |= dict(flatten(dict(kwargs or {}), "kwargs"))
    params |= {
        "num_processes": str(spec.num_processes),
        "world_size": str(spec.max_processes),
        "nproc_per_node": str(spec.nproc_per_node),
        "local_mode": str(spec.local_mode),
    }
    if spec.train_data is not None:
        data = spec.train_data
        params["train_data"] = (data if isinstance(data, str) else getattr(data, "__qualname__", repr(data)))[
            :MAX_PARAM_CHARS
        ]
    for key, value in (spec.conf or {}).items():
        if not SECRET_NAME.search(str(key)) and "@" not in str(value):
            params[f"conf.{key}"] = str(value)[:MAX_PARAM_CHARS]
    return {name: text for name, text in params.items() if not SECRET_NAME.search(name)}
