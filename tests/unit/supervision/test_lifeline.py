"""The lifeline protocol on real sockets: mutual authentication, strict messages, replay, pings and
silence, commands, the output transfer; the sync and async clients against one LifelineServer."""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchdist.spark.wire.output_store import OutputManifest, read_output
from airflow_provider_torchdist.supervision.lifeline import (
    LIFELINE_VERSION,
    MAX_LINE_BYTES,
    AppEvent,
    AsyncOwnerConnection,
    DoneEvent,
    ErrorEvent,
    LifelineError,
    LifelineServer,
    LifelineUnreachable,
    LineEvent,
    MalformedMessage,
    MetricEvent,
    OwnerConnection,
    OwnerSession,
    RunGone,
    RunState,
    RunStatus,
    decode,
    encode,
    owner_proof,
    parse_server_message,
    query_status,
    read_message,
    supervisor_proof,
)
from airflow_provider_torchdist.supervision.lifeline.handshake import status_digest
from airflow_provider_torchdist.supervision.lifeline.sealed import MAX_SEALED_LINE_BYTES
from tests.unit.conftest import publish_value, wait_until

SECRET = b"s" * 32
RUN = "run-1"


class Recorder:
    """An OwnerListener that notes what owners do; ``refuse`` maps a command to an error reply."""

    def __init__(self) -> None:
        self.attached: list[OwnerSession] = []
        self.commands: list[tuple[str, str]] = []
        self.lost: list[tuple[OwnerSession, str]] = []
        self.refuse: dict[str, str] = {}
        self.whys: list[str | None] = []

    def owner_attached(self, owner: OwnerSession) -> None:
        self.attached.append(owner)

    def owner_command(self, owner: OwnerSession, command: str, why: str | None = None) -> str | None:
        self.commands.append((owner.kind, command))
        self.whys.append(why)
        return self.refuse.get(command)

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        self.lost.append((owner, why))


@pytest.fixture
def served():
    servers: list[LifelineServer] = []

    def serve(state: RunState | None = None, listener: Any = None, **kwargs: Any) -> LifelineServer:
        server = LifelineServer(
            RUN, SECRET, "127.0.0.1", state or RunState(), listener or Recorder(), **kwargs
        )
        server.start()
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.close("test over", timeout=0.5)


def connect(server: LifelineServer, **kwargs: Any) -> OwnerConnection:
    host, port = server.address
    return OwnerConnection(host, port, kwargs.pop("run_id", RUN), kwargs.pop("secret", SECRET), **kwargs)


def collect(conn: OwnerConnection) -> list[Any]:
    return list(conn.events())


def raw(server: LifelineServer) -> tuple[socket.socket, io.BufferedReader]:
    sock = socket.create_connection(server.address, timeout=5)
    return sock, sock.makefile("rb")


def send_sealed(conn: OwnerConnection, line: bytes) -> None:
    """Send the supervisor ``line`` as the owner's next message, sealed as the client seals its own."""
    with conn._write_lock:
        conn._sock.sendall(conn._sealer.seal(line))


def hello(**fields: Any) -> bytes:
    msg = {"v": LIFELINE_VERSION, "run_id": RUN, "kind": "task", "since": 0, "nonce": "a" * 32, **fields}
    return json.dumps(msg).encode() + b"\n"


# -- the handshake ---------------------------------------------------------------------------------


def test_an_owner_authenticates_both_ways_and_gets_the_status(served):
    state = RunState(clock=lambda: 7.0)  # a still clock: no time elapses
    state.add_line("one")
    state.set_application("app-7", "http://ui")
    server = served(state)
    with connect(server) as conn:
        assert conn.status == RunStatus(state="starting", app_id="app-7", ui_url="http://ui", last_seq=1)
    assert query_status(*server.address, RUN, SECRET).last_seq == 1


def test_a_wrong_secret_is_refused_clearly(served):
    server = served()
    with pytest.raises(LifelineError, match="the owner's credentials were refused"):
        connect(server, secret=b"x" * 32)
    assert server.listener.attached == []


def _fake_supervisor(welcome: Any) -> tuple[tuple[str, int], threading.Thread, list[dict]]:
    """An endpoint that does the supervisor's part of the handshake up to its last message, which
    ``welcome(client_nonce)`` makes; returns its address, its thread and the owner's proofs."""
    listener = socket.create_server(("127.0.0.1", 0))
    proofs: list[dict] = []

    def serve() -> None:
        conn, _ = listener.accept()
        reader = conn.makefile("rb")
        client = json.loads(reader.readline())
        conn.sendall(encode({"nonce": "b" * 32}))
        proofs.append(json.loads(reader.readline()))
        conn.sendall(encode(welcome(client["nonce"])))
        conn.close()
        listener.close()

    thread = threading.Thread(target=serve)
    thread.start()
    return listener.getsockname(), thread, proofs


def test_the_client_refuses_an_endpoint_that_cannot_prove_it_is_the_supervisor():
    """The owner signs what it fetches: an endpoint on the run's port must prove the secret too."""

    def impostor(client_nonce: str) -> dict:  # right shape, proof made with another secret
        status = RunStatus("running").to_dict()
        proof = supervisor_proof(b"o" * 32, RUN, client_nonce, "b" * 32, status_digest(status))
        return {"ok": True, "proof": proof, "status": status}

    (host, port), thread, proofs = _fake_supervisor(impostor)
    with pytest.raises(LifelineError, match=f"wrong credentials for run {RUN}"):
        OwnerConnection(host, port, RUN, SECRET)
    thread.join()
    assert set(proofs[0]) == {"proof"}


def test_a_status_swapped_in_under_the_supervisors_proof_is_refused():
    """The proof covers the status: one changed on the way (a run "succeeded" with another
    output, another run's metrics) is refused, though the proof itself is the supervisor's."""

    def in_the_middle(client_nonce: str) -> dict:
        proved = RunStatus("running").to_dict()
        proof = supervisor_proof(SECRET, RUN, client_nonce, "b" * 32, status_digest(proved))
        return {"ok": True, "proof": proof, "status": {**proved, "state": "succeeded"}}

    (host, port), thread, _ = _fake_supervisor(in_the_middle)
    with pytest.raises(LifelineError, match=f"wrong credentials for run {RUN}"):
        query_status(host, port, RUN, SECRET)
    thread.join()


def test_the_status_digest_is_the_same_on_both_ends_of_the_wire():
    status = RunStatus("running", metrics=[{"step": 1, "loss": 0.1 + 0.2, "lr": 3e-4, "x": float("nan")}])
    sent = status.to_dict()
    assert status_digest(decode(encode(sent))) == status_digest(sent)


def test_proofs_are_domain_separated():
    owner = owner_proof(SECRET, RUN, "task", "b" * 32, "a" * 32)
    assert owner != supervisor_proof(SECRET, RUN, "a" * 32, "b" * 32, status_digest({}))
    assert owner != owner_proof(SECRET, RUN, "trigger", "b" * 32, "a" * 32)


def test_another_runs_supervisor_means_this_run_is_gone(served):
    """And it does not say which run it is: nobody has proved anything yet (issue 40)."""
    server = served()
    with pytest.raises(RunGone, match="this supervisor runs another run, not run-2") as raised:
        connect(server, run_id="run-2")
    assert RUN not in str(raised.value).replace("run-2", "")


def test_nothing_listening_means_the_run_is_gone():
    port = socket.create_server(("127.0.0.1", 0))
    address = port.getsockname()
    port.close()
    with pytest.raises(RunGone, match=f"run {RUN} at 127.0.0.1:{address[1]} is gone"):
        OwnerConnection(*address, RUN, SECRET)
    with pytest.raises(RunGone):
        asyncio.run(AsyncOwnerConnection.connect(*address, RUN, SECRET))


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"v": 2}, "lifeline version 3, the client 2"),
        ({"v": True}, "lifeline version 3, the client True"),
        ({"since": True}, "bad since"),
        ({"since": -1}, "bad since"),
        ({"kind": "admin"}, "kind must be one of"),
        ({"nonce": "A" * 32}, "bad nonce"),
        ({"run_id": ""}, "bad run_id"),
        ({"extra": 1}, "unexpected \\['extra'\\]"),
    ],
)
def test_a_malformed_hello_is_refused_with_a_reason(served, fields, error):
    server = served()
    sock, reader = raw(server)
    sock.sendall(hello(**fields))
    reply = json.loads(reader.readline())
    assert set(reply) == {"error", "code"}
    assert re.search(error, reply["error"]), reply
    assert reader.readline() == b""  # and it closes
    sock.close()


def test_the_hello_has_one_deadline_and_a_size_limit(served):
    server = served(hello_timeout=0.3)
    sock, reader = raw(server)
    started = time.monotonic()
    sock.sendall(b'{"v": 1')  # and nothing more
    assert reader.readline() == b""
    assert time.monotonic() - started < 3
    sock.close()
    sock, reader = raw(server)
    sock.sendall(b"x" * 5000)  # a hello over 4 KiB: dropped unread
    try:
        assert reader.readline() == b""
    except ConnectionResetError:
        pass  # closed with the rest unread
    sock.close()


def test_connections_waiting_to_authenticate_are_capped(served):
    server = served(max_pending=2)
    idle = [raw(server) for _ in range(2)]
    time.sleep(0.1)
    with pytest.raises(LifelineUnreachable, match="too many connections"):
        connect(server)
    for sock, reader in idle:
        reader.close()
        sock.close()

    def authenticates() -> bool:
        try:
            return query_status(*server.address, RUN, SECRET).state == "starting"
        except LifelineUnreachable:
            return False

    wait_until(authenticates, what="a free slot")


# -- messages --------------------------------------------------------------------------------------


def test_lines_over_the_limit_are_refused():
    with pytest.raises(MalformedMessage):
        decode(b"{" + b" " * MAX_LINE_BYTES + b"}\n")
    with pytest.raises(MalformedMessage):
        read_message(io.BytesIO(b"x" * (MAX_LINE_BYTES + 5) + b"\n"))
    with pytest.raises(MalformedMessage, match="over the lifeline's"):
        encode({"k": "line", "text": "x" * MAX_LINE_BYTES})
    assert read_message(io.BytesIO(b'{"k": "pi')) is None  # closed mid-line


@pytest.mark.parametrize(
    "msg",
    [
        {"k": "line", "seq": True, "text": "x"},
        {"k": "line", "seq": 0, "text": "x"},
        {"k": "line", "seq": 1, "text": 5},
        {"k": "line", "seq": 1},
        {"k": "app", "app_id": "", "ui_url": None},
        {"k": "metric", "m": [1]},
        {"k": "done", "status": {**RunStatus("running").to_dict()}},
        {"k": "done", "status": {**RunStatus("failed").to_dict(), "last_seq": False}},
        {"k": "output", "manifest": {"format": "json", "type": "int", "size": 1, "sha256": "ab"}},
        {"k": "surprise"},
    ],
)
def test_server_messages_are_checked_strictly(msg):
    with pytest.raises(MalformedMessage):
        parse_server_message(msg)


def test_status_round_trips_and_is_checked_strictly():
    status = RunStatus(
        state="failed",
        error="boom",
        failures=[{"rank": 1, "host": "h", "exitcode": 1, "traceback": "tb"}],
        metrics=[{"rank": 0, "loss": 0.5}],
        output={"format": "json", "type": "int", "size": 2, "sha256": "0" * 64},
        last_seq=3,
    )
    assert RunStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status
    for bad in (
        {"state": "paused"},
        {"failures": [{"rank": True}]},
        {"failures": [{"rank": 0, "who": "x"}]},
        {"output": {"format": "json", "type": "int", "size": -1, "sha256": "0" * 64}},
        {"metrics": [1]},
        {"app_id": ""},
        {"error_kind": "oops"},
        {"error_kind": ["training"]},
    ):
        with pytest.raises(MalformedMessage):
            RunStatus.from_dict({**status.to_dict(), **bad})
    with pytest.raises(MalformedMessage, match="missing \\['last_seq'\\]"):
        RunStatus.from_dict({k: v for k, v in status.to_dict().items() if k != "last_seq"})


WORLD_SIZES = [
    {"time": 1767225600.0, "world_size": 4, "reason": "start"},
    {"time": 1767225660, "world_size": 2, "reason": "lost node 1"},
]


def test_world_sizes_round_trip_and_are_checked_strictly():
    status = RunStatus(state="succeeded", world_sizes=WORLD_SIZES)
    assert RunStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status
    good = WORLD_SIZES[0]
    for bad in (
        {"world_sizes": {"a": 1}},
        {"world_sizes": [1]},
        {"world_sizes": [{**good, "world_size": 0}]},
        {"world_sizes": [{**good, "world_size": True}]},
        {"world_sizes": [{**good, "world_size": 10**300}]},
        {"world_sizes": [{**good, "world_size": 2.0}]},
        {"world_sizes": [{**good, "time": "now"}]},
        {"world_sizes": [{**good, "time": float("nan")}]},
        {"world_sizes": [{**good, "time": -1.0}]},
        {"world_sizes": [{**good, "reason": None}]},
        {"world_sizes": [{**good, "reason": "x" * 501}]},
        {"world_sizes": [{**good, "extra": 1}]},
        {"world_sizes": [{"time": 1.0, "world_size": 2}]},
    ):
        with pytest.raises(MalformedMessage, match="world_sizes"):
            RunStatus.from_dict({**status.to_dict(), **bad})
    # A supervisor of an earlier release sends none: a run started before an upgrade still reattaches.
    earlier = {k: v for k, v in status.to_dict().items() if k != "world_sizes"}
    assert RunStatus.from_dict(earlier).world_sizes == []


def test_a_finished_run_carries_the_well_formed_world_sizes_that_fit():
    state = RunState()
    long = {"time": 2.0, "world_size": 3, "reason": "y" * 10_000}
    state.finish(
        "succeeded", world_sizes=[*WORLD_SIZES, {"time": 1.0, "world_size": -2, "reason": ""}, 7, long]
    )
    carried = state.status().world_sizes
    assert carried[:2] == WORLD_SIZES and len(carried) == 3
    assert carried[2]["reason"] == "y" * 500 and len(long["reason"]) == 10_000  # cut, not changed
    assert RunStatus.from_dict(state.status().to_dict()).world_sizes == carried
    many = [{"time": float(i), "world_size": 2, "reason": "r" * 400} for i in range(1000)]
    fitting = RunState()
    fitting.finish("succeeded", world_sizes=many)
    kept = fitting.status().world_sizes
    assert 0 < len(kept) < 1000 and kept[-1] == many[-1]  # the newest that fit


def test_a_status_query_shows_the_metric_history_so_far_and_the_time_elapsed(served):
    """A deferred run has no task process: its progress is what a status query returns."""
    now = [100.0]
    state = RunState(clock=lambda: now[0])
    server = served(state)
    state.set_running()
    state.add_metric({"rank": 0, "step": 0, "loss": 1.0})
    now[0] = 102.5
    state.add_metric({"rank": 0, "step": 1, "loss": 0.5})
    status = query_status(*server.address, RUN, SECRET)
    assert (status.state, status.elapsed_s) == ("running", 2.5)
    assert [m["step"] for m in status.metrics] == [0, 1]
    now[0] = 110.0
    state.finish("succeeded")
    now[0] = 500.0  # the duration of an ended run stays what it was
    assert query_status(*server.address, RUN, SECRET).elapsed_s == 10.0
    with pytest.raises(MalformedMessage, match="elapsed_s"):
        RunStatus.from_dict({**status.to_dict(), "elapsed_s": -1})
    # A supervisor of an earlier release sends none: a run started before an upgrade still reattaches.
    earlier = {k: v for k, v in status.to_dict().items() if k != "elapsed_s"}
    assert RunStatus.from_dict(earlier).elapsed_s == 0.0


def test_a_failed_run_says_whether_training_or_the_run_around_it_failed():
    from airflow_provider_torchdist.errors import SparkSubmitFailed, TrainingFailed
    from airflow_provider_torchdist.supervision.task_side import raise_for_failure

    training = RunState()
    training.finish("failed", error="rendezvous timed out", error_kind="training")
    run = RunState()
    run.finish("failed", error="spark-submit exited with 1")
    done = RunState()
    done.finish("succeeded")
    assert (training.status().error_kind, run.status().error_kind, done.status().error_kind) == (
        "training",
        "run",
        None,
    )
    # As hook.run() raises them: a failed outcome without rank failures is still TrainingFailed.
    with pytest.raises(TrainingFailed, match="rendezvous timed out"):
        raise_for_failure(training.status())
    with pytest.raises(SparkSubmitFailed, match="spark-submit exited with 1"):
        raise_for_failure(run.status())
    raise_for_failure(done.status())
    with pytest.raises(ValueError, match="error_kind"):
        RunState().finish("failed", error_kind="mystery")


def test_a_status_stays_under_the_line_limit():
    state = RunState()
    for step in range(40_000):
        state.add_metric({"rank": 0, "step": step, "loss": 0.123456789})
    huge = {"rank": 0, "message": "m" * 100_000, "traceback": "t" * 100_000}
    assert state.finish("failed", failures=[huge] * 8)
    status = state.status()
    assert len(encode({"k": "done", "status": status.to_dict()})) < MAX_LINE_BYTES
    assert status.metrics[-1]["step"] == 39_999  # the newest kept
    assert status.failures[0]["traceback"].endswith("t" * 100)


# -- the stream ------------------------------------------------------------------------------------


def test_replay_after_since_then_live_events_then_done(served):
    state = RunState()
    for i in range(1, 6):
        state.add_line(f"line {i}")
    server = served(state)
    with connect(server, since=2) as conn:
        events = conn.events()
        assert [next(events) for _ in range(3)] == [
            LineEvent(3, "line 3"),
            LineEvent(4, "line 4"),
            LineEvent(5, "line 5"),
        ]
        state.add_line("line 6")
        state.set_application("app-1", None)
        state.add_metric({"rank": 0, "loss": 1.0})
        assert next(events) == LineEvent(6, "line 6")
        assert next(events) == AppEvent("app-1", None)
        assert next(events) == MetricEvent({"rank": 0, "loss": 1.0})
        state.finish("failed", error="boom")
        done = next(events)
        assert isinstance(done, DoneEvent) and done.status.error == "boom" and done.status.last_seq == 6
        assert list(events) == []
        assert conn.done == done.status


def test_an_ended_run_replays_and_says_done_at_once(served):
    state = RunState(replay_lines=2)
    for i in range(1, 4):
        state.add_line(f"line {i}")
    state.set_application("app-1", "http://ui")
    state.finish("succeeded")
    with connect(served(state)) as conn:
        assert conn.status.state == "succeeded"
        events = collect(conn)
    assert events[:3] == [AppEvent("app-1", "http://ui"), LineEvent(2, "line 2"), LineEvent(3, "line 3")]
    assert isinstance(events[3], DoneEvent) and len(events) == 4


OPERATION = "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"


def test_a_connect_runs_operation_reaches_owners_in_its_app_event_and_status(served):
    state = RunState()
    state.set_application("app-1", None, OPERATION)
    with connect(served(state)) as conn:
        assert conn.status.operation == OPERATION
        assert next(conn.events()) == AppEvent("app-1", None, OPERATION)
    assert RunStatus.from_dict(json.loads(json.dumps(state.status().to_dict()))).operation == OPERATION
    # Without one, the status says nothing of it: an owner of an earlier release reads it as before.
    assert "operation" not in RunState().status().to_dict()


@pytest.mark.parametrize("operation", ["", "abc", OPERATION.split("/")[0], OPERATION + "/x", 5])
def test_an_app_event_or_status_with_a_bad_operation_is_malformed(operation):
    with pytest.raises(MalformedMessage, match="malformed 'app'"):
        parse_server_message({"k": "app", "app_id": "app-1", "ui_url": None, "operation": operation})
    with pytest.raises(MalformedMessage, match="operation"):
        RunStatus.from_dict({**RunState().status().to_dict(), "operation": operation})


def test_a_closed_lifeline_before_done_raises_with_the_supervisors_reason(served):
    server = served()
    conn = connect(server)
    wait_until(lambda: server.listener.attached, what="the owner")
    server.listener.attached[0].close("another owner took run-1 over")
    with pytest.raises(
        LifelineError, match="closed the lifeline before the run ended: another owner took run-1 over"
    ):
        collect(conn)
    conn.close()


def test_commands_reach_the_listener_and_refusals_come_back(served):
    server = served()
    server.listener.refuse["release"] = "run run-1 is still running"
    with connect(server) as conn:
        conn.release()
        conn.detach()
        conn.stop()
        conn.stop("timeout")
        assert next(conn.events()) == ErrorEvent("run run-1 is still running")
        wait_until(lambda: len(server.listener.commands) == 4, what="four commands")
    assert server.listener.commands == [
        ("task", "release"),
        ("task", "detach"),
        ("task", "stop"),
        ("task", "stop"),
    ]
    # A stop says why ("timeout": its ranks are told so); the others carry no reason.
    assert server.listener.whys == [None, None, None, "timeout"]
    wait_until(lambda: server.listener.lost, what="the loss")
    owner, why = server.listener.lost[0]
    assert owner.detached and why == "it closed the connection"


def test_a_malformed_command_gets_an_error_and_the_lifeline_stays(served):
    server = served()
    with connect(server) as conn:
        send_sealed(conn, b'{"k": "dance"}\n')
        assert next(conn.events()) == ErrorEvent(
            "unknown command 'dance' (one of ping, stop, detach, release, fetch)"
        )
        conn.stop()
        wait_until(lambda: server.listener.commands, what="stop")


@pytest.mark.parametrize(
    "command, error",
    [
        (b'{"k": "stop", "why": ""}', "malformed 'stop': why must be a string of 1 to 200 characters"),
        (b'{"k": "stop", "why": 5}', "malformed 'stop': why must be a string of 1 to 200 characters"),
        (b'{"k": "stop", "why": "' + b"x" * 201 + b'"}', "malformed 'stop': why must be a string"),
        (b'{"k": "detach", "why": "timeout"}', "malformed command: missing [], unexpected ['why']"),
    ],
)
def test_a_stop_reason_that_is_not_one_is_refused_and_nothing_is_stopped(served, command, error):
    server = served()
    with connect(server) as conn:
        send_sealed(conn, command + b"\n")
        event = next(conn.events())
        assert isinstance(event, ErrorEvent) and event.message.startswith(error)
    assert server.listener.commands == []


def test_a_stop_reason_reaches_the_listener_without_control_characters(served):
    server = served()
    with connect(server) as conn:
        send_sealed(conn, b'{"k": "stop", "why": "time\\u001b[2Jout"}\n')
        wait_until(lambda: server.listener.whys, what="the stop")
    assert server.listener.whys == ["time\\x1b[2Jout"]


def test_an_oversized_command_ends_the_lifeline(served):
    server = served()
    with connect(server) as conn:
        with pytest.raises(LifelineError, match="malformed message"):
            conn._sock.sendall(b"x" * (MAX_SEALED_LINE_BYTES + 10) + b"\n")
            collect(conn)
    wait_until(lambda: server.listener.lost, what="the loss")
    assert "malformed" in server.listener.lost[0][1]


# -- pings and silence ---------------------------------------------------------------------------


def test_a_silent_owner_is_lost_and_a_pinging_one_is_not(served):
    server = served(silence_s=0.4)
    pinging = connect(server, ping_interval=0.05)
    silent = connect(server, ping_interval=60)
    wait_until(lambda: server.listener.lost, timeout=5, what="the silent owner's loss")
    time.sleep(0.3)
    assert [(o.kind, why) for o, why in server.listener.lost] == [("task", "it sent nothing for 0.4 s")]
    assert server.listener.lost[0][0] is server.listener.attached[1]
    pinging.close()
    silent.close()


def test_an_idle_supervisor_pings_and_a_silent_one_is_noticed(served):
    talking = served(ping_interval=0.05)
    with connect(talking, silence=0.4) as conn:
        thread = threading.Thread(target=lambda: pytest.raises(LifelineError, collect, conn), daemon=True)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive()  # still reading: the pings keep it going
    mute = served(ping_interval=60)
    with connect(mute, silence=0.3) as conn, pytest.raises(LifelineError, match="sent nothing for 0.3 s"):
        collect(conn)


# -- the output ------------------------------------------------------------------------------------


def finished_with_output(tmp_path: Path, value: Any, lines: tuple[str, ...] = ()) -> RunState:
    """A run that logged ``lines`` and succeeded with ``value`` as rank 0's output."""
    staging = tmp_path / "staging"
    staging.mkdir()
    path = publish_value(value, staging)
    manifest = OutputManifest.read(path)
    state = RunState()
    for text in lines:
        state.add_line(text)
    fields = {
        "format": manifest.format,
        "type": manifest.type,
        "size": manifest.size,
        "sha256": manifest.sha256,
    }
    state.finish("succeeded", output=fields, output_path=path)
    return state


@pytest.mark.parametrize("value", [{"accuracy": 0.9}, {"weights": list(range(200_000)), "tag": {1, 2}}])
def test_fetch_writes_the_output_with_a_manifest_the_hook_reads(served, tmp_path, value):
    server = served(finished_with_output(tmp_path, value))
    dest = tmp_path / "dest"
    dest.mkdir()
    with connect(server) as conn:
        path = conn.fetch_output(dest)
    assert path == dest / "output.pkl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert OutputManifest.read(path) is not None
    assert read_output(path) == value
    assert sorted(p.name for p in dest.iterdir()) == ["output.pkl", "output.pkl.manifest.json"]


def test_fetched_bytes_that_do_not_match_are_refused(served, tmp_path):
    state = finished_with_output(tmp_path, "a value")
    _, path = state.output()
    data = path.read_bytes()
    path.write_bytes(data[:-2] + b'!"')  # same size, other bytes
    dest = tmp_path / "dest"
    dest.mkdir()
    with connect(served(state)) as conn, pytest.raises(LifelineError, match="does not match its SHA-256"):
        conn.fetch_output(dest)
    assert list(dest.iterdir()) == []


def test_an_output_file_that_changed_size_is_not_sent(served, tmp_path):
    state = finished_with_output(tmp_path, "a value")
    state.output()[1].write_bytes(b"longer than before")
    dest = tmp_path / "dest"
    dest.mkdir()
    with connect(served(state)) as conn, pytest.raises(LifelineError, match="no output to send.*not the"):
        conn.fetch_output(dest)


def test_no_output_gives_none(served, tmp_path):
    state = RunState()
    state.finish("failed", error="boom")
    with connect(served(state)) as conn:
        assert conn.fetch_output(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_fetch_before_the_end_is_refused(served):
    server = served()
    with connect(server) as conn:
        conn._send({"k": "fetch"})
        assert next(conn.events()) == ErrorEvent("the run has not ended: its output is fetched after 'done'")


# -- the async client ------------------------------------------------------------------------------


def test_the_async_client_follows_commands_and_checks_credentials(served):
    state = RunState()
    state.add_line("before")
    server = served(state)
    host, port = server.address

    async def scenario() -> list[Any]:
        conn = await AsyncOwnerConnection.connect(host, port, RUN, SECRET, since=0, ping_interval=0.05)
        assert conn.status.last_seq == 1
        seen = []
        async for event in conn.events():
            seen.append(event)
            if event == LineEvent(1, "before"):
                await conn.detach()
                state.add_line("after")
            elif event == LineEvent(2, "after"):
                state.finish("succeeded")
        await conn.release()  # after done: fine even when the supervisor has gone
        await conn.close()
        with pytest.raises(LifelineError, match="credentials were refused"):
            await AsyncOwnerConnection.connect(host, port, RUN, b"w" * 32)
        return seen

    seen = asyncio.run(scenario())
    assert seen[:2] == [LineEvent(1, "before"), LineEvent(2, "after")] and isinstance(seen[2], DoneEvent)
    wait_until(lambda: len(server.listener.commands) == 2, what="the commands")
    assert server.listener.commands == [("trigger", "detach"), ("trigger", "release")]


def test_the_async_client_notices_a_closed_lifeline(served):
    server = served()
    host, port = server.address

    async def scenario() -> None:
        conn = await AsyncOwnerConnection.connect(host, port, RUN, SECRET)
        server.close("torn down")
        with pytest.raises(LifelineError, match="before the run ended: torn down"):
            async for _ in conn.events():
                pass
        await conn.close()
        with pytest.raises(RunGone):
            await AsyncOwnerConnection.connect(host, port, RUN, SECRET)

    asyncio.run(scenario())


def test_clients_refuse_bad_arguments():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        OwnerConnection("127.0.0.1", 1, RUN, b"short")
    with pytest.raises(ValueError, match="kind must be one of"):
        OwnerConnection("127.0.0.1", 1, RUN, SECRET, kind="boss")
    with pytest.raises(ValueError, match="since"):
        OwnerConnection("127.0.0.1", 1, RUN, SECRET, since=True)
