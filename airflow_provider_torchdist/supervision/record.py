"""A run's address, as Airflow keeps it between tries: the record in ``task_state_store``.

A durable or deferred run outlives the task process that started it. What a later owner (a retry,
a trigger, ``execute_complete``) needs to find it goes in the record: the run id and the address of
its supervisor; over Spark Connect, also the Connect session the run's job goes to (from its
start) and, once the job runs, its operation id: with them a retry that finds the supervisor gone
interrupts the job it left on the server. No secret does: the owner's credential is derived from the run id with the
deployment's output signing key (:func:`owner_secret`), which every worker and triggerer of the
deployment holds already, so the record, trigger kwargs and the state store hold nothing to steal.

The credential is also bound to the task instance the run belongs to (:class:`TaskBinding`), which
the reader takes from where it stands (the try's own task instance, the view's URL), never from the
record: a record copied into another task instance's state proves nothing there, so its run's
status, log and metrics are never shown or taken for another task's.

The Training view holds less than an owner: a status credential (:func:`status_secret`) derived
from a status-only key, which the supervisor accepts for ``status`` queries and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from airflow_provider_torchdist import __version__
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.wire.connect_ids import (
    canonical_uuid,
    connect_operation,
    split_operation,
)
from airflow_provider_torchdist.supervision.lifeline.address import unix_path

RECORD_KEY = "torchdist_run"
#: 2: the owner's credential is bound to the task instance (records of 1 are refused, saying so).
RECORD_VERSION = 2
#: Set only for a Spark Connect run: the session from its start, the operation once its job reports
#: (absent from records of earlier releases).
CONNECT_FIELDS = frozenset({"connect_session_id", "connect_operation_id"})
#: The latest deadline a record may hold: the end of year 9999 (seconds since the epoch), the last
#: moment a datetime can say; a larger one is not ours.
LATEST_DEADLINE = 253402300799.0
#: Fields a record of an earlier release may lack.
OPTIONAL_FIELDS = CONNECT_FIELDS | {"deadline", "max_tries"}


@dataclass(frozen=True)
class TaskBinding:
    """The task instance a run belongs to, as the run's owners prove they act for it.

    Not the try: a durable retry takes over the run an earlier try of the same task instance
    started, and a deferred try's trigger owns it in the try's stead.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1

    def __post_init__(self) -> None:
        names = (self.dag_id, self.run_id, self.task_id)
        if not all(isinstance(n, str) and n for n in names) or type(self.map_index) is not int:
            raise ValueError(
                f"a task binding needs non-empty dag_id, run_id and task_id and an int map_index: {self!r}"
            )

    @classmethod
    def of(cls, ti: Any) -> TaskBinding | None:
        """The binding of Airflow's task instance ``ti``; None when it does not say who it is (a
        hook used outside a task)."""
        map_index = getattr(ti, "map_index", -1)
        try:
            return cls(
                getattr(ti, "dag_id", None),  # type: ignore[arg-type]
                getattr(ti, "run_id", None),  # type: ignore[arg-type]
                getattr(ti, "task_id", None),  # type: ignore[arg-type]
                -1 if map_index is None else map_index,
            )
        except ValueError:
            return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TaskBinding:
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError(f"not a task binding: {data!r}")
        return cls(**data)

    def canonical(self) -> bytes:
        """What the owner's credential is derived with: unambiguous for any names."""
        return json.dumps([self.dag_id, self.run_id, self.task_id, self.map_index]).encode()


@dataclass(frozen=True)
class RunRecord:
    """Where a live run is, and how long it waits for an owner (see the module docstring)."""

    run_id: str
    #: The supervisor's lifeline: a TCP host and port, or ``unix:<socket path>`` and port 0 for a
    #: local one (in the run's private staging directory: owners check that it still is, see
    #: :mod:`~airflow_provider_torchdist.supervision.lifeline.address`).
    host: str
    port: int
    durable: bool
    reattach_timeout: float
    version: int = RECORD_VERSION
    provider_version: str = __version__
    connect_session_id: str | None = None
    connect_operation_id: str | None = None
    #: When the task's ``execution_timeout`` ends the run (seconds since the epoch), None without
    #: one: set from the try that started the run, so that a try resumed after a deferral, or a
    #: durable retry that takes the run over, gets what is left of it, not a fresh timeout.
    deadline: float | None = None
    #: The task instance's ``max_tries`` when the run started, None when unknown. Airflow raises it
    #: when a user clears the task: a later try that finds a higher one was asked for a new run,
    #: not for this one.
    max_tries: int | None = None
    #: The task instance whose owners may own the run: set by whoever holds the record, from where
    #: it stands (:meth:`bound_to`), never stored with it (see the module docstring).
    task: TaskBinding | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["task"]
        return data

    def bound_to(self, task: TaskBinding | None) -> RunRecord:
        """This record as the task instance ``task`` holds it (None: outside a task)."""
        return replace(self, task=task)

    def secret(self, key: bytes | None = None) -> bytes:
        """The credential of this run's owners, as this record's holder derives it."""
        return owner_secret(self.run_id, key, self.task)

    def status_secret(self, view_key: bytes | None = None) -> bytes:
        """The credential that may only ask this run's status (the Training view's), derived from
        the status view key ``view_key`` (see :func:`status_secret`)."""
        return status_secret(self.run_id, view_key, self.task)

    def with_operation(self, operation: str) -> RunRecord:
        """This record with the run's Spark Connect operation (``<session id>/<operation id>``)."""
        ids = split_operation(operation)
        if ids is None:
            raise ValueError(f"{operation!r} is not a Spark Connect operation")
        return replace(self, connect_session_id=ids[0], connect_operation_id=ids[1])

    def with_session(self, session_id: str) -> RunRecord:
        """This record with the Spark Connect session the run's job goes to (no operation yet)."""
        if canonical_uuid(session_id) is None:
            raise ValueError(f"{session_id!r} is not a Spark Connect session id")
        return replace(self, connect_session_id=session_id, connect_operation_id=None)

    @property
    def connect_operation(self) -> str | None:
        """The run's Spark Connect operation as :func:`with_operation` took it, or None."""
        if self.connect_session_id is None or self.connect_operation_id is None:
            return None
        return connect_operation(self.connect_session_id, self.connect_operation_id)

    @classmethod
    def from_dict(cls, data: Any) -> RunRecord:
        """A record as :meth:`to_dict` stored it; refused, saying why, when it is not one of ours."""
        names = {f.name for f in fields(cls)} - {"task"}  # never from storage
        if not isinstance(data, dict) or not names - OPTIONAL_FIELDS <= set(data):
            raise InvalidTrainingConfig(
                f"The task's stored run record {data!r} is not one this provider wrote (fields {sorted(names)} "
                "expected). Clear the task's state (task_state_store key 'torchdist_run') to start afresh."
            )
        if data["version"] != RECORD_VERSION:
            raise InvalidTrainingConfig(
                f"The task's stored run record has version {data['version']!r}, written by "
                f"airflow-provider-torchdist {data.get('provider_version')!r}; this is {__version__} "
                f"(record version {RECORD_VERSION}), which cannot reattach to it. Clear the task's state "
                "(task_state_store key 'torchdist_run'), or finish the run with the version that started it."
            )
        record = cls(**{name: data[name] for name in names if name in data})
        checks = (
            isinstance(record.run_id, str) and record.run_id,
            isinstance(record.host, str) and record.host,
            type(record.port) is int
            and (record.port == 0 if _is_unix(record.host) else 0 < record.port < 65536),
            type(record.durable) is bool,
            type(record.reattach_timeout) in (int, float) and record.reattach_timeout > 0,
            canonical_uuid(record.connect_session_id) is not None
            if record.connect_session_id is not None
            else record.connect_operation_id is None,
            record.connect_operation_id is None or canonical_uuid(record.connect_operation_id) is not None,
            record.deadline is None
            or (type(record.deadline) in (int, float) and 0 < record.deadline <= LATEST_DEADLINE),
            record.max_tries is None or (type(record.max_tries) is int and record.max_tries >= 0),
        )
        if not all(checks):
            raise InvalidTrainingConfig(f"The task's stored run record {data!r} is malformed; clear it.")
        return record


def _is_unix(host: object) -> bool:
    """A ``unix:`` host naming an absolute socket path (whether it is a private one is checked where
    it is connected to)."""
    path = unix_path(host) if isinstance(host, str) else None
    return path is not None and path.startswith("/") and "\0" not in path


def owner_secret(run_id: str, key: bytes | None = None, task: TaskBinding | None = None) -> bytes:
    """The credential of the run's owners: HMAC-SHA256 of the run id and the task instance it
    belongs to (none for a run started outside a task) under the signing key."""
    if key is None:
        from airflow_provider_torchdist.outputs.signing import signing_key

        key = signing_key()
    bound = b"" if task is None else b"|task:" + task.canonical()
    return hmac.new(key, b"torchdist-owner:" + run_id.encode() + bound, hashlib.sha256).digest()


def status_secret(run_id: str, view_key: bytes | None = None, task: TaskBinding | None = None) -> bytes:
    """The credential that may only ask the run's status: HMAC-SHA256 of the run id and its task
    instance under the status view key (``[torchdist] view_status_key``, itself derived from the
    signing key: :func:`~airflow_provider_torchdist.outputs.signing.status_view_key`; None: derived
    here from this machine's signing key). The supervisor gets it beside the owner's credential
    and accepts it for a ``status`` query only, so the API server, which holds only the view key,
    can show a run but never stop, follow or fetch it, nor sign an output."""
    if view_key is None:
        from airflow_provider_torchdist.outputs.signing import signing_key, status_view_key

        view_key = status_view_key(signing_key())
    bound = b"" if task is None else b"|task:" + task.canonical()
    return hmac.new(view_key, b"torchdist-status:" + run_id.encode() + bound, hashlib.sha256).digest()
