"""The base of the run channel's messages: a kind, a schema of typed fields, and the error for
anything malformed (:mod:`~airflow_provider_torchdist.spark.wire.protocol` holds the kinds).

Standard library only.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ProtocolError(ValueError):
    """A message that is not one of the protocol's, or has a field of the wrong type."""


def checked_field(
    obj: dict[str, Any], kind: str, key: str, types: tuple[type, ...], optional: bool = False
) -> Any:
    """``obj[key]`` when it has one of ``types`` (never a bool for a number), else a ProtocolError."""
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return value
    names = " or ".join(t.__name__ for t in types) + (" or null" if optional else "")
    raise ProtocolError(f"{kind!r} message: field {key!r} must be {names}, got {type(value).__name__}")


class Message:
    """The base of every message kind: its fields go to the wire under the keys of ``SCHEMA``,
    checked on the way in."""

    KIND: ClassVar[str]
    #: ``(attribute, wire key, JSON types, may be null)`` per field.
    SCHEMA: ClassVar[tuple[tuple[str, str, tuple[type, ...], bool], ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        return {key: getattr(self, attr) for attr, key, _, _ in self.SCHEMA}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Any:
        values = {
            attr: checked_field(obj, cls.KIND, key, types, null) for attr, key, types, null in cls.SCHEMA
        }
        msg = cls(**values)
        msg.check()
        return msg

    def check(self) -> None:
        """Raise :class:`ProtocolError` for well-typed but impossible values."""
