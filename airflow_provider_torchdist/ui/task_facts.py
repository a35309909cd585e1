"""What Airflow and the run's lifeline know of one task instance, for the Training view.

:class:`AirflowTaskFacts` reads the metadata DB in the API server: the task instance's state, its
XCom ``metrics``, its run record (``task_state_store`` key ``torchdist_run``) and its rendered
``num_processes`` (the world size). :func:`live_history` asks the run's supervisor for the history
so far: while a run is deferred no task process pushes XCom, and the supervisor has every report
as it happens. :func:`metric_history` chooses between the two.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from airflow_provider_torchdist.links import MLFLOW_RUN_XCOM_KEY
from airflow_provider_torchdist.operators.checkpoint_registry import CHECKPOINTS_XCOM_KEY
from airflow_provider_torchdist.operators.xcom import METRICS_XCOM_KEY, RANK_STEP_TIMES_XCOM_KEY
from airflow_provider_torchdist.supervision.record import RECORD_KEY, TaskBinding
from airflow_provider_torchdist.ui.figures import FINISHED_STATES

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

#: A rendered ``num_processes``: ``"4"``, or an elastic ``"2:4"`` (group 1 is the most ranks).
_RENDERED_WORLD_SIZE = re.compile(r"\s*(?:[0-9]+\s*:\s*)?([0-9]+)\s*")
#: How long the view waits for a run's supervisor before it shows XCom's history instead.
LIVE_TIMEOUT_S = 3.0

#: ``live_history``'s signature: a stored run record in, the run's history (None: not live) out.
LiveHistory = Callable[[Any, "TaskBinding"], "list[dict[str, Any]] | None"]


@dataclass(frozen=True)
class TaskFacts:
    """One task instance as the view needs it. ``history`` is XCom ``metrics`` (empty when none);
    ``run_record`` is the stored run record as stored (None when none); ``operator`` is the task's
    operator class and ``custom_operator_name`` its display name (``@task.torch_distributor``), as
    Airflow records them on the task instance (None when unknown)."""

    state: str | None
    history: list[Any] = field(default_factory=list)
    run_record: Any = None
    world_size: int | None = None
    operator: str | None = None
    custom_operator_name: str | None = None
    #: The task's MLflow run page (XCom ``mlflow_run_url``; ``mlflow_conn_id``), None when none.
    mlflow_run_url: str | None = None
    #: The kept checkpoints of a succeeded run (XCom ``checkpoints``, best first); None when none.
    checkpoints: Any = None
    #: Each rank's step time (XCom ``rank_step_times``), once the run has ended; None when none.
    rank_step_times: Any = None


#: The operators whose tasks train (the operator, and the ``@task.torch_distributor`` decorator's).
TRAINING_OPERATORS = frozenset({"TorchDistributorOperator", "TorchDistributorDecoratedOperator"})
TRAINING_DECORATOR = "@task.torch_distributor"


def is_training_task(facts: TaskFacts) -> bool:
    """Whether the task instance is one of this provider's training tasks. Airflow shows a plugin's
    task instance tab on every task (an external view cannot be limited to an operator), so the view
    asks. A subclass of the operator, under a name of its own, counts once it has left a run record
    or metrics; an instance whose operator Airflow did not record counts too (nothing says it is not)."""
    if facts.operator is None or facts.run_record is not None or facts.history:
        return True
    return facts.operator in TRAINING_OPERATORS or facts.custom_operator_name == TRAINING_DECORATOR


class TaskFactsReader(Protocol):
    def read(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> TaskFacts | None:
        """The task instance's facts; None when there is no such task instance."""
        ...


def world_size_of(rendered_fields: Any) -> int | None:
    """The rendered ``num_processes`` (the operator's world size; for an elastic ``"MIN:MAX"``, MAX,
    the most ranks the run trains with); None when it is not there."""
    value = rendered_fields.get("num_processes") if isinstance(rendered_fields, dict) else None
    if isinstance(value, str):
        match = _RENDERED_WORLD_SIZE.fullmatch(value)
        value = int(match[1]) if match else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class AirflowTaskFacts:
    """:class:`TaskFactsReader` over Airflow's metadata DB (the API server's session)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def read(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> TaskFacts | None:
        from airflow.models.renderedtifields import RenderedTaskInstanceFields as RTIF
        from airflow.models.taskinstance import TaskInstance as TI
        from sqlalchemy import select

        row = self.session.execute(
            select(TI.state, TI.operator, TI.custom_operator_name).where(
                TI.dag_id == dag_id, TI.run_id == run_id, TI.task_id == task_id, TI.map_index == map_index
            )
        ).one_or_none()
        if row is None:
            return None
        rendered = self.session.scalar(
            select(RTIF.rendered_fields).where(
                RTIF.dag_id == dag_id,
                RTIF.run_id == run_id,
                RTIF.task_id == task_id,
                RTIF.map_index == map_index,
            )
        )
        history = self._xcom_value(METRICS_XCOM_KEY, dag_id, run_id, task_id, map_index)
        mlflow_url = self._xcom_value(MLFLOW_RUN_XCOM_KEY, dag_id, run_id, task_id, map_index)
        kept = self._xcom_value(CHECKPOINTS_XCOM_KEY, dag_id, run_id, task_id, map_index)
        step_times = self._xcom_value(RANK_STEP_TIMES_XCOM_KEY, dag_id, run_id, task_id, map_index)
        return TaskFacts(
            state=None if row.state is None else str(getattr(row.state, "value", row.state)),
            history=history,
            run_record=self._run_record(dag_id, run_id, task_id, map_index),
            world_size=world_size_of(rendered),
            operator=row.operator,
            custom_operator_name=row.custom_operator_name or None,
            mlflow_run_url=mlflow_url if isinstance(mlflow_url, str) and mlflow_url else None,
            checkpoints=kept or None,
            rank_step_times=step_times or None,
        )

    def _xcom_value(self, key: str, dag_id: str, run_id: str, task_id: str, map_index: int) -> Any:
        from airflow.models.xcom import XComModel

        query = XComModel.get_many(
            run_id=run_id,
            key=key,
            task_ids=task_id,
            dag_ids=dag_id,
            map_indexes=map_index,
            limit=1,
        )
        found = self.session.scalars(query).first()
        if found is None:
            return [] if key == METRICS_XCOM_KEY else None
        value = XComModel.deserialize_value(found)
        if key != METRICS_XCOM_KEY:
            return value
        # A custom XCom backend may keep a reference (a path) here instead of the list: no chart then.
        return value if isinstance(value, list) else []

    def _run_record(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> Any:
        try:  # task_state_store is Airflow 3.3+; before it, runs are followed through XCom only
            from airflow.state import TaskScope, get_state_backend
        except ImportError:
            return None
        scope = TaskScope(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=map_index)
        stored = get_state_backend().get(scope, RECORD_KEY)
        if stored is None:
            return None
        try:
            return json.loads(stored)
        except (TypeError, ValueError):
            return None


#: How long an answer (a history, or none) is reused for the same run: every open view polls every
#: 2 s, and a run that does not answer must not tie up the API server's threads on each poll.
LIVE_CACHE_S = 2.0
NOT_LIVE_CACHE_S = 5.0
_cache: dict[tuple[str, int, str], tuple[float, list[dict[str, Any]] | None]] = {}
_cache_lock = threading.Lock()


def lifeline_hosts() -> set[str]:
    """The hosts whose supervisors the view may ask: ``[torchdist] lifeline_host`` (where this
    deployment's supervisors listen, 127.0.0.1 by default) and ``[torchdist] view_lifeline_hosts``
    (comma-separated, for workers on other machines). A record naming any other host is not asked:
    whoever can write a task's state store must not make the API server connect where they like.
    The same allow-list as the task side's (:mod:`~airflow_provider_torchdist.supervision.lifeline_hosts`)."""
    from airflow_provider_torchdist.supervision.lifeline_hosts import lifeline_hosts as allowed

    return allowed()


def _view_key() -> bytes | None:
    """The status view key (``[torchdist] view_status_key``, or derived from this API server's
    signing key if it has one; never made here): it may ask a run's status, nothing else."""
    from airflow_provider_torchdist.outputs.signing import view_status_key

    try:
        return view_status_key()
    except (ValueError, OSError):  # SigningKeyError is a ValueError: a bad key shows XCom's history
        return None


def live_history(
    stored_record: Any, task: TaskBinding, clock: Callable[[], float] = time.monotonic
) -> list[dict[str, Any]] | None:
    """The run's history from its supervisor (a ``status`` connection: it reads, it owns nothing);
    None when the record is not one of ours, names a host outside :func:`lifeline_hosts`, this
    server has no status view key (:func:`_view_key`), or no supervisor proves itself there
    within :data:`LIVE_TIMEOUT_S` as the supervisor of a run of ``task`` (asked with the status
    credential, which may do nothing else; the task instance the view shows: a record copied
    from another task instance's state proves nothing here). Answers are reused for
    :data:`LIVE_CACHE_S` (:data:`NOT_LIVE_CACHE_S` for none)."""
    from airflow_provider_torchdist.supervision.lifeline import LifelineError, query_status
    from airflow_provider_torchdist.supervision.lifeline_hosts import lifeline_address_allowed
    from airflow_provider_torchdist.supervision.record import RunRecord

    try:
        record = RunRecord.from_dict(stored_record).bound_to(task)
    except ValueError:
        return None
    # A local (unix:) lifeline is asked only when it is a socket in a private directory of this
    # user: the client refuses any other (lifeline.address.check_private_socket).
    if not lifeline_address_allowed(record.host, lifeline_hosts()):
        return None
    key = (record.host, record.port, record.run_id, task)
    now = clock()
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
    view_key = _view_key()
    history: list[dict[str, Any]] | None = None
    if view_key is not None:
        try:
            status = query_status(
                record.host,
                record.port,
                record.run_id,
                record.status_secret(view_key),
                timeout=LIVE_TIMEOUT_S,
            )
            history = status.metrics
        except (LifelineError, OSError, ValueError):
            history = None
    with _cache_lock:
        if len(_cache) > 1024:  # old runs' entries: drop the expired ones
            for stale in [k for k, (until, _) in _cache.items() if until <= now]:
                del _cache[stale]
        _cache[key] = (now + (LIVE_CACHE_S if history is not None else NOT_LIVE_CACHE_S), history)
    return history


def metric_history(facts: TaskFacts, live: LiveHistory, task: TaskBinding) -> tuple[str | None, list[Any]]:
    """Where the view's history comes from, and the history: the live run's while the task is not
    finished and its run answers as a run of ``task`` (``"live"``), else XCom's (``"xcom"``; None
    when it holds none)."""
    if facts.state not in FINISHED_STATES and facts.run_record is not None:
        history = live(facts.run_record, task)
        if history is not None:
            return "live", history
    return ("xcom" if facts.history else None), facts.history
