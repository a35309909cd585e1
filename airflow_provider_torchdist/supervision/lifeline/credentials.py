"""Which credential a lifeline client proved: the owner's, good for every kind, or the Training
view's status credential (``record.status_secret``), good for a ``status`` query only.

The supervisor holds both (``supervisor.json``); the API server holds only the status key, so
whoever can read its configuration can watch a run but never stop, follow or fetch it.
"""

from __future__ import annotations

import hmac
from typing import Any

from airflow_provider_torchdist.supervision.lifeline.handshake import owner_proof

#: The kind the server's handshake reports for a ``status`` query proved with the status
#: credential: its answer is proved with that credential too.
STATUS_ONLY = "status-only"


def proved_kind(
    proof: Any,
    run_id: str,
    kind: str,
    nonces: tuple[str, str],
    owner: bytes,
    status: bytes | None,
) -> str | None:
    """``kind`` when ``proof`` (over ``nonces``: server's, client's) proves the owner's credential;
    :data:`STATUS_ONLY` when ``kind`` is ``status`` and it proves the status credential; None when
    it proves neither (a status credential offered for ``task`` or ``trigger`` proves nothing)."""
    if not isinstance(proof, str):
        return None
    candidates = [(owner, kind)] + ([(status, STATUS_ONLY)] if kind == "status" and status else [])
    for secret, proved in candidates:
        if hmac.compare_digest(proof, owner_proof(secret, run_id, kind, *nonces)):
            return proved
    return None
