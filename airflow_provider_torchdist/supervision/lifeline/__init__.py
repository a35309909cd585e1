"""The lifeline: how a run's owner (its task, a trigger, a retry) talks to the run's supervisor.

A supervised run (:mod:`~airflow_provider_torchdist.supervision.supervisor`) outlives the task that started it.
Its owner follows it over one connection (a unix socket in the run's private staging directory
when all owners are local, else TCP: :mod:`.address`) of JSON lines (at most ``MAX_LINE_BYTES`` each,
newline included; anything longer is refused). Both ends prove they hold the run's owner secret
(:func:`~airflow_provider_torchdist.supervision.record.owner_secret`, bound to the run's task
instance): the owner, because it may stop the run; the supervisor, because the owner signs whatever
output it fetches from it, and shows the status it answers with as that task instance's.

The handshake (``HELLO_TIMEOUT_S`` for all of it)::

    owner      -> {"v": 3, "run_id": ..., "kind": "task"|"trigger"|"status", "since": n, "nonce": cn}
    supervisor -> {"nonce": sn}                        or {"error": ..., "code": ...} and it closes
    owner      -> {"proof": HMAC(secret, "owner|<run_id>|<kind>|<sn>|<cn>")}
    supervisor -> {"ok": true, "proof": HMAC(secret, "supervisor|<run_id>|<cn>|<sn>|<sha256 of status>"),
                   "status": {...}}
                                                       or {"error": ...} and it closes

(A supervisor of another run answers ``wrong_run`` without saying which run it has.) A ``status``
connection ends there (:func:`query_status`). An owner then gets the kept log lines after line
``since`` (the last ``REPLAY_LINES``), then the live stream: ``line``, ``app``, ``metric`` and,
once, ``done`` with the final status; the supervisor sends ``ping`` when it has nothing else to
say, and ``closing`` (why) before it closes. The owner sends ``ping`` every ``PING_INTERVAL_S``
(``OWNER_SILENCE_S`` without a message is a lost owner), and the commands ``stop``, ``detach``,
``release`` and ``fetch`` (after ``done``: ``{"k": "output", "manifest": {...}}`` and exactly
``size`` raw bytes, which must match the manifest of ``done``).

After the handshake every message, both ways, is sealed (:mod:`.sealed`): sent as
``<HMAC-SHA256 hex> <JSON line>`` under a key of the session and direction
(``HMAC(secret, "torchdist-lifeline-session|<direction>|<run_id>|<cn>|<sn>")``), over the message's
number in its direction (from 0, not sent) and its bytes. A message injected, changed, reordered,
replayed or dropped on the way fails its MAC and ends the connection (:class:`StreamTampered`); an
owner takes a run for ended only from a sealed ``done``, and any other end for a broken lifeline.

Example::

    with OwnerConnection(host, port, run_id, owner_secret(run_id, task=task)) as owner:
        for event in owner.events():
            if isinstance(event, LineEvent):
                print(event.text)
        path = owner.fetch_output(Path(tmp))  # rank 0's output file with its manifest, or None
        owner.release()                       # the supervisor tears the run down

The supervisor's side is :class:`LifelineServer`, which serves a :class:`RunState` (the plain
object the supervisor updates) and tells an :class:`OwnerListener` what owners do. Standard library
(and this package's standard-library modules) only.

The package's modules, by job: :mod:`.messages` (limits, errors, the JSON-line encoder and
decoder), :mod:`.address` (where it listens, and which local sockets an owner trusts),
:mod:`.slots` and :mod:`.retry` (a connection flood cannot keep owners out), :mod:`.status`
(:class:`RunStatus`), :mod:`.events` (what an owner gets, strictly parsed), :mod:`.handshake`
(the mutual HMAC authentication), :mod:`.sealed` (the MAC of every later message), :mod:`.client` and :mod:`.async_client` (the owner's two clients), :mod:`.output` (rank 0's output over the lifeline),
:mod:`.run_state` (:class:`RunState`), :mod:`.session` and :mod:`.server` (the supervisor's side).
This module only re-exports their public names.
"""

from __future__ import annotations

from airflow_provider_torchdist.supervision.lifeline.async_client import AsyncOwnerConnection
from airflow_provider_torchdist.supervision.lifeline.client import OwnerConnection, query_status
from airflow_provider_torchdist.supervision.lifeline.events import (
    AppEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    LineEvent,
    MetricEvent,
    parse_server_message,
)
from airflow_provider_torchdist.supervision.lifeline.handshake import owner_proof, supervisor_proof
from airflow_provider_torchdist.supervision.lifeline.messages import (
    HELLO_TIMEOUT_S,
    LIFELINE_VERSION,
    MAX_LINE_BYTES,
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    REPLAY_LINES,
    LifelineError,
    LifelineUnreachable,
    MalformedMessage,
    RunGone,
    decode,
    encode,
    read_message,
)
from airflow_provider_torchdist.supervision.lifeline.run_state import RunState
from airflow_provider_torchdist.supervision.lifeline.sealed import StreamTampered
from airflow_provider_torchdist.supervision.lifeline.server import LifelineServer
from airflow_provider_torchdist.supervision.lifeline.session import OwnerListener, OwnerSession
from airflow_provider_torchdist.supervision.lifeline.status import RunStatus

__all__ = [
    "AppEvent",
    "AsyncOwnerConnection",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "HELLO_TIMEOUT_S",
    "LIFELINE_VERSION",
    "LifelineError",
    "LifelineServer",
    "LifelineUnreachable",
    "LineEvent",
    "MAX_LINE_BYTES",
    "MalformedMessage",
    "MetricEvent",
    "OWNER_SILENCE_S",
    "OwnerConnection",
    "OwnerListener",
    "OwnerSession",
    "PING_INTERVAL_S",
    "REPLAY_LINES",
    "RunGone",
    "RunState",
    "RunStatus",
    "StreamTampered",
    "decode",
    "encode",
    "owner_proof",
    "parse_server_message",
    "query_status",
    "read_message",
    "supervisor_proof",
]
