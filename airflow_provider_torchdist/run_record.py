"""A run's address, as Airflow keeps it between tries: the record in ``task_state_store``.

A durable or deferred run outlives the task process that started it. What a later owner (a retry,
a trigger, ``execute_complete``) needs to find it goes in the record: the run id and the address of
its supervisor. No secret does: the owner's credential is derived from the run id with the
deployment's output signing key (:func:`owner_secret`), which every worker and triggerer of the
deployment holds already, so the record, trigger kwargs and the state store hold nothing to steal.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import asdict, dataclass, fields
from typing import Any

from airflow_provider_torchdist import __version__
from airflow_provider_torchdist.errors import InvalidTrainingConfig

RECORD_KEY = "torchdist_run"
RECORD_VERSION = 1


@dataclass(frozen=True)
class RunRecord:
    """Where a live run is, and how long it waits for an owner (see the module docstring)."""

    run_id: str
    host: str
    port: int
    durable: bool
    reattach_timeout: float
    version: int = RECORD_VERSION
    provider_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> RunRecord:
        """A record as :meth:`to_dict` stored it; refused, saying why, when it is not one of ours."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not names <= set(data):
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
        record = cls(**{name: data[name] for name in names})
        checks = (
            isinstance(record.run_id, str) and record.run_id,
            isinstance(record.host, str) and record.host,
            type(record.port) is int and 0 < record.port < 65536,
            type(record.durable) is bool,
            type(record.reattach_timeout) in (int, float) and record.reattach_timeout > 0,
        )
        if not all(checks):
            raise InvalidTrainingConfig(f"The task's stored run record {data!r} is malformed; clear it.")
        return record


def owner_secret(run_id: str, key: bytes | None = None) -> bytes:
    """The credential of the run's owners: HMAC-SHA256 of the run id under the signing key."""
    if key is None:
        from airflow_provider_torchdist.signing import signing_key

        key = signing_key()
    return hmac.new(key, b"torchdist-owner:" + run_id.encode(), hashlib.sha256).digest()
