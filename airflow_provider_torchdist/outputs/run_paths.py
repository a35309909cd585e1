"""Where a task's checkpoints and large outputs live: one directory per task, ids encoded.

``$AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>[@map]`` is the same for every try of a
task in a DAG run, so a retry resumes where the last try stopped; ``<output_path>/<dag>/<run>/
<task>[@map]-try<n>.pkl`` is one try's large output. Each id is exactly one percent-encoded path
component (:func:`path_component`): no run id leaves the base or shares another's directory.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

from airflow_provider_torchdist.errors import InvalidTrainingConfig


def airflow_home() -> str:
    return os.path.expanduser(os.environ.get("AIRFLOW_HOME", "~/airflow"))


def path_component(value: Any, what: str) -> str:
    """``value`` (a DAG, run or task id) as exactly one path component, injectively.

    Percent-encoded with nothing kept (``/`` becomes ``%2F``, ``%`` becomes ``%25``), and a leading
    ``.`` as ``%2E``: ``".."``, ``"a/../b"`` and ``"a/b"`` stay one level below the base, never
    ``.`` or ``..``, and distinct ids give distinct names (``quote`` never writes ``@`` or a bare
    ``.`` first, so no encoded id looks like another's).
    """
    encoded = quote(str(value), safe="")
    if not encoded:
        raise InvalidTrainingConfig(f"{what} is empty, so it cannot name this task's directory")
    return "%2E" + encoded[1:] if encoded.startswith(".") else encoded


def run_components(ti: Any) -> tuple[str, str, str]:
    """``(<dag>, <run>, <task>[@<map index>])``, each one encoded path component."""
    map_index = getattr(ti, "map_index", -1)
    task = path_component(ti.task_id, "task_id")
    if map_index not in (-1, None):
        task += f"@{int(map_index)}"  # quote() always encodes "@": no task id can look like this
    return path_component(ti.dag_id, "dag_id"), path_component(ti.run_id, "run_id"), task


def default_checkpoint_dir(ti: Any) -> str:
    """This task's checkpoint directory, the same for all its tries in one DAG run."""
    return os.path.join(airflow_home(), "torchdist-checkpoints", *run_components(ti))


def output_base(output_path: str | None) -> str:
    """``output_path``, or ``file://$AIRFLOW_HOME/torchdist-outputs``."""
    return output_path or "file://" + os.path.join(airflow_home(), "torchdist-outputs")


def output_uri(output_path: str | None, ti: Any) -> str:
    """Where this try's large output goes: ``<output_path>/<dag>/<run>/<task>[@map]-try<n>.pkl``."""
    dag, run, task = run_components(ti)
    return "/".join([output_base(output_path).rstrip("/"), dag, run, f"{task}-try{int(ti.try_number)}.pkl"])
