"""torch's ``c10d`` rendezvous for elastic runs, with every state it reads signed with the run's key.

The dynamic rendezvous keeps its state in the store as a pickle, and every agent unpickles what it
reads there. The store has no authentication, so anything that can reach the driver's port could
plant a pickle and run code on every executor. This backend wraps torch's own
(``C10dRendezvousBackend``, through the public ``RendezvousBackend`` interface and torch's
rendezvous registry): each state is written with an HMAC-SHA256 under a key derived from the
run's **elastic key**, and a state whose tag does not verify is refused before torch sees its bytes.

The elastic key is random, made by the driver (:class:`~..elastic.task.RendezvousStore`), and handed
to each node the driver verifies, in its claim's answer on the run channel
(:mod:`~..wire.channel_auth`). It is not derived from the run's token: over Spark Connect the token
is in every task of the job, and whoever holds it alone must not be able to seal a state. A node of
the run holds the key, as it must to take part (see ``docs/security.md``).

The key reaches the handler through this process (:func:`use_key`, by run id), not through the
rendezvous configuration, which torch logs.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    c10d_rendezvous_backend,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

#: The ``rdzv_backend`` name registered with torchrun's rendezvous registry.
BACKEND = "torchdist-c10d"
_TAG = hashlib.sha256().digest_size
#: The key of each elastic run this process takes part in, by run id.
_KEYS: dict[str, bytes] = {}


def run_key(elastic_key: bytes, purpose: str) -> bytes:
    """A key for one use (``"rendezvous"``, ``"restart"``) derived from the run's elastic key."""
    return hmac.new(elastic_key, f"torchdist elastic {purpose}".encode(), hashlib.sha256).digest()


def seal(key: bytes, data: bytes) -> bytes:
    """``data`` with its tag in front."""
    return hmac.new(key, data, hashlib.sha256).digest() + data


def unseal(key: bytes, sealed: bytes, what: str) -> bytes:
    """The data of a sealed value; raises :class:`RendezvousStateError` when its tag does not verify."""
    tag, data = sealed[:_TAG], sealed[_TAG:]
    if len(sealed) < _TAG or not hmac.compare_digest(tag, hmac.new(key, data, hashlib.sha256).digest()):
        raise RendezvousStateError(
            f"the {what} in the driver's rendezvous store is not signed with this run's key: something "
            "other than this run's agents wrote it. Firewall the driver's ports from everything but the "
            "executors."
        )
    return data


class SignedBackend(RendezvousBackend):
    """torch's c10d backend, with each state sealed on the way in and verified on the way out."""

    def __init__(self, inner: RendezvousBackend, key: bytes) -> None:
        self._inner = inner
        self._key = key

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._inner.get_state()
        if found is None:
            return None
        sealed, token = found
        return unseal(self._key, sealed, "rendezvous state"), token

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        found = self._inner.set_state(seal(self._key, state), token)
        if found is None:
            return None
        sealed, new_token, written = found
        return unseal(self._key, sealed, "rendezvous state"), new_token, written


def use_key(run_id: str, elastic_key: bytes) -> None:
    """Let this process's handlers for ``run_id`` sign with the run's key (from its elastic key)."""
    _KEYS[run_id] = run_key(elastic_key, "rendezvous")


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic handler on the signed backend (``rdzv_configs`` as for ``c10d``)."""
    key = _KEYS.get(params.run_id)
    if key is None:
        raise RendezvousStateError(f"no key for elastic run {params.run_id!r} in this process")
    inner, store = c10d_rendezvous_backend.create_backend(params)
    handler: Any = dynamic_rendezvous.create_handler(store, SignedBackend(inner, key), params)
    return handler


def register() -> str:
    """Make ``BACKEND`` known to torchrun (idempotent); returns its name, for ``LaunchConfig``."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    return BACKEND
