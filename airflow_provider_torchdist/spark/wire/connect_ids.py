"""Spark Connect's session and operation ids as a run's events carry them: ``<session>/<operation>``,
each a canonical UUID. Standard library only."""

from __future__ import annotations

import uuid
from typing import Any


def connect_operation(session_id: str, operation_id: str) -> str:
    """A Spark Connect operation as the run's events carry it: ``<session id>/<operation id>``."""
    return f"{session_id}/{operation_id}"


def canonical_uuid(text: Any) -> str | None:
    """``text`` when it is a UUID in canonical form (lowercase, hyphenated), as Spark Connect's
    session and operation ids are; None otherwise (other spellings of a UUID included)."""
    try:
        return text if isinstance(text, str) and str(uuid.UUID(text)) == text else None
    except ValueError:
        return None


def split_operation(text: Any) -> tuple[str, str] | None:
    """``(session id, operation id)`` of :func:`connect_operation`'s text; None when it is not one."""
    if not isinstance(text, str):
        return None
    session_id, _, operation_id = text.partition("/")
    if canonical_uuid(session_id) is None or canonical_uuid(operation_id) is None:
        return None
    return session_id, operation_id
