"""The lifeline's mutual authentication: the HMAC proofs of both ends, the checks of a run id and
a secret, and the owner's half of the handshake that both clients drive (the supervisor's half is
:meth:`~airflow_provider_torchdist.supervision.lifeline.server.LifelineServer._handshake`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from typing import Any

from airflow_provider_torchdist.supervision.lifeline.address import where
from airflow_provider_torchdist.supervision.lifeline.messages import (
    KINDS,
    LIFELINE_VERSION,
    MIN_SECRET_BYTES,
    LifelineError,
    LifelineUnreachable,
    RunGone,
    _exact_keys,
    _is_int,
    _require,
    encode,
)
from airflow_provider_torchdist.supervision.lifeline.sealed import (
    OWNER_TO_SUPERVISOR,
    SUPERVISOR_TO_OWNER,
    Opener,
    Sealer,
    session_keys,
)
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus

_NONCE = re.compile(r"[0-9a-f]{32}")


def owner_proof(secret: bytes, run_id: str, kind: str, server_nonce: str, client_nonce: str) -> str:
    """What the owner answers the supervisor's challenge with."""
    data = b"|".join([b"owner", run_id.encode(), kind.encode(), server_nonce.encode(), client_nonce.encode()])
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def status_digest(status: dict[str, Any]) -> str:
    """SHA-256 of a status as JSON with sorted keys and no spaces: the same for the dict the
    supervisor sends and the one the owner decodes from it."""
    return hashlib.sha256(json.dumps(status, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def supervisor_proof(secret: bytes, run_id: str, client_nonce: str, server_nonce: str, status: str) -> str:
    """What the supervisor proves itself with, and the status it answers with (``status``: its
    :func:`status_digest`), so that no status can be swapped in under the proof; another domain
    than :func:`owner_proof`, so one can never be replayed as the other."""
    data = b"|".join(
        [b"supervisor", run_id.encode(), client_nonce.encode(), server_nonce.encode(), status.encode()]
    )
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _check_secret(secret: Any) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a lifeline secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def _check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200 or not run_id.isprintable():
        raise ValueError(
            f"a run id must be a non-empty printable string of at most 200 characters: {run_id!r}"
        )
    return run_id


# -- the owner's side of the handshake, for both clients ------------------------------------------


class _ClientHandshake:
    """The owner's half of the mutual authentication, without I/O: both clients drive it."""

    def __init__(self, host: str, port: int, run_id: str, secret: bytes, kind: str, since: int) -> None:
        self.run_id = _check_run_id(run_id)
        self.secret = _check_secret(secret)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not _is_int(since) or since < 0:
            raise ValueError(f"since must be a line number >= 0, got {since!r}")
        self.kind, self.since = kind, since
        self.where = where(host, port)
        self.nonce = secrets.token_hex(16)
        self._server_nonce = ""

    def gone(self, why: str) -> RunGone:
        return RunGone(
            f"run {self.run_id} at {self.where} is gone: it ended and was torn down, or never started ({why})"
        )

    def unreachable(self, why: str) -> LifelineUnreachable:
        return LifelineUnreachable(
            f"the supervisor of run {self.run_id} at {self.where} did not answer: {why}"
        )

    def not_connected(self, exc: OSError) -> LifelineError:
        """What a failed TCP connect means: nothing listens there (the run is gone), or no answer."""
        if isinstance(exc, (ConnectionRefusedError, ConnectionResetError)):
            return self.gone(str(exc))
        # a timeout, an unreachable network, a name that does not resolve
        return self.unreachable(str(exc) or type(exc).__name__)

    def failed(self, exc: BaseException, timeout: float) -> BaseException:
        """What a client raises when ``exc`` ended the handshake (its connection closed): a
        :class:`LifelineError` as it is, a timeout or a broken connection as the LifelineError
        it means, anything else as it is."""
        if isinstance(exc, LifelineError) or not isinstance(exc, OSError):
            return exc
        if isinstance(exc, TimeoutError):
            return self.unreachable(f"no handshake within {timeout:g} s")
        if isinstance(exc, ConnectionError):  # reset or cut mid-handshake: a busy supervisor shuts
            return self.unreachable(f"the connection broke during the handshake ({exc})")  # the newest
        return LifelineError(f"the lifeline to run {self.run_id} at {self.where} broke: {exc}")

    def hello(self) -> bytes:
        return encode(
            {
                "v": LIFELINE_VERSION,
                "run_id": self.run_id,
                "kind": self.kind,
                "since": self.since,
                "nonce": self.nonce,
            }
        )

    def answer(self, msg: dict[str, Any] | None) -> bytes:
        """The supervisor's challenge in, the owner's proof out."""
        if msg is None:
            # Not "gone": a supervisor that is busy (a flood takes slots) closes a connection that
            # has not spoken yet. A run that is gone refuses the connect; a retry finds out which.
            raise self.unreachable("the connection closed before the challenge")
        if "error" in msg:
            text = msg["error"] if isinstance(msg["error"], str) else repr(msg["error"])
            if msg.get("code") == "wrong_run":  # another run's supervisor took the port: ours is not there
                raise self.gone(text)
            if msg.get("code") == "busy":
                raise self.unreachable(text)
            raise LifelineError(
                f"the supervisor at {self.where} refused the lifeline to run {self.run_id}: {text}"
            )
        _exact_keys(msg, {"nonce"}, f"the endpoint at {self.where} answered with no lifeline challenge")
        _require(
            isinstance(msg["nonce"], str) and bool(_NONCE.fullmatch(msg["nonce"])), "malformed challenge"
        )
        self._server_nonce = msg["nonce"]
        return encode(
            {"proof": owner_proof(self.secret, self.run_id, self.kind, self._server_nonce, self.nonce)}
        )

    def welcome(self, msg: dict[str, Any] | None) -> RunStatus:
        """The supervisor's proof and the run's status, checked."""
        if msg is None:
            raise self.unreachable("the connection closed before the welcome")
        if "error" in msg:
            raise LifelineError(
                f"the supervisor at {self.where} refused the lifeline to run {self.run_id}: {msg['error']}"
            )
        _exact_keys(msg, {"ok", "proof", "status"}, f"malformed handshake answer from {self.where}")
        _require(isinstance(msg["status"], dict), "malformed handshake answer: the status is not an object")
        expected = supervisor_proof(
            self.secret, self.run_id, self.nonce, self._server_nonce, status_digest(msg["status"])
        )
        if (
            msg["ok"] is not True
            or not isinstance(msg["proof"], str)
            or not hmac.compare_digest(msg["proof"], expected)
        ):
            raise LifelineError(
                f"the endpoint at {self.where} answered with the wrong credentials for run {self.run_id}: it is not "
                "that run's supervisor (another process took its port, or it holds another signing key). "
                "Nothing from it is used."
            )
        return RunStatus.from_dict(msg["status"])

    def stream(self) -> tuple[Sealer, Opener]:
        """After :meth:`welcome`: the owner's sealer of its commands and opener of the
        supervisor's messages, under this session's keys (:mod:`.sealed`)."""
        keys = session_keys(self.secret, self.run_id, self.nonce, self._server_nonce)
        who = f"the supervisor of run {self.run_id} at {self.where}"
        return Sealer(keys[OWNER_TO_SUPERVISOR]), Opener(keys[SUPERVISOR_TO_OWNER], who)
