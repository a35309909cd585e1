"""Issue 40 item 4: a connection flood cannot keep a run's owner out of its lifeline.

Real LifelineServers and real sockets throughout: attackers that connect and say nothing (or trickle
a hello a byte at a time) and reconnect each connection the server drops, from one or from several
loopback source addresses (127.0.0.0/8 is all loopback on Linux), while a real owner connects; and
the local lifeline, a unix socket in a private directory, with records that point elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused
from airflow_provider_torchdist.supervision.lifeline import (
    AsyncOwnerConnection,
    LifelineServer,
    LifelineUnreachable,
    OwnerConnection,
    RunState,
    query_status,
)
from airflow_provider_torchdist.supervision.lifeline.address import (
    UnsafeLifelineSocket,
    lifeline_bind,
    slot_source,
    unix_host,
)
from airflow_provider_torchdist.supervision.lifeline.retry import retry_unreachable
from airflow_provider_torchdist.supervision.lifeline.slots import HandshakeSlots
from airflow_provider_torchdist.supervision.record import RunRecord
from airflow_provider_torchdist.supervision.task_side import GONE, connect_owner, run_state
from tests.unit.conftest import wait_until

SECRET = b"s" * 32
RUN = "run-1"
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


class Flood:
    """Attackers that keep ``width`` connections open from each source address, saying nothing (or,
    with ``trickle``, a byte of a hello every 0.1 s), and reconnect each one the server drops."""

    def __init__(self, address: tuple[str, int], sources: list[str], width: int, trickle: bool) -> None:
        self.address, self.sources, self.width, self.trickle = address, sources, width, trickle
        self.busy = 0  # connections turned away with "busy"
        self.dropped = 0  # connections the server closed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _connect(self, source: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((source, 0))
        sock.settimeout(2)
        sock.connect(self.address)
        return sock

    def _run(self) -> None:
        held: dict[socket.socket, str] = {}
        next_byte = time.monotonic()
        while not self._stop.is_set():
            for source in self.sources:  # top every source up to its width
                for _ in range(self.width - sum(1 for s in held.values() if s == source)):
                    held[self._connect(source)] = source
            readable, _, _ = select.select(list(held), [], [], 0.05)
            for sock in readable:  # an answer ("busy") or the end of the connection: reconnect
                try:
                    answer = sock.recv(4096)
                except OSError:
                    answer = b""
                self.busy += b'"busy"' in answer
                self.dropped += not answer
                del held[sock]
                sock.close()
            if self.trickle and time.monotonic() >= next_byte:
                next_byte = time.monotonic() + 0.1
                for sock in held:
                    try:
                        sock.send(b" ")  # JSON allows whitespace: a hello that never ends
                    except OSError:
                        pass
            self._stop.wait(0.01)  # pace the reconnects: 2 CPUs are shared by the whole test run
        for sock in held:
            sock.close()


class Relay:
    """A TCP relay on 127.0.0.1 that holds each chunk for ``delay`` s before passing it on, as a
    network between an owner and its supervisor does (it connects on to the supervisor at once)."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target, self.delay = target, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._open: list[socket.socket] = []

    def __enter__(self) -> Relay:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        for sock in self._open:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            self._open += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                time.sleep(self.delay)  # the latency this relay stands for, not a wait for anything
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def served():
    servers: list[LifelineServer] = []

    def serve(bind: str = "127.0.0.1", **kwargs: object) -> LifelineServer:
        server = LifelineServer(RUN, SECRET, bind, RunState(), **kwargs)
        server.start()
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.close("test over", timeout=0.5)


# -- TCP: per-source caps, eviction of the busiest source, a short deadline per line ---------------


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
@pytest.mark.parametrize(
    ("sources", "width"),
    [(["127.0.0.2"], 20), ([f"127.0.0.{i}" for i in range(2, 10)], 3)],
    ids=["one source", "eight loopback addresses"],
)
def test_a_connection_flood_cannot_keep_the_owner_out(served, sources, width, trickle):
    """Old code: 16 slots, held for 10 s each, from anywhere: 0 owners got in (the proof's 0 of 230).
    All of loopback is one source, the owner's own (127.0.0.1) included: its hello, sent at once,
    keeps its slot, while the flood's own silent connections make room for it."""
    server = served()
    with Flood(server.address, sources, width=width, trickle=trickle):
        wait_until(lambda: server.pending == 16, what="the flood to hold every slot")
        for _ in range(3):  # while it goes on, an owner gets in at once, every time
            started = time.monotonic()
            with OwnerConnection(*server.address, RUN, SECRET, timeout=5) as owner:
                assert owner.status.state == "starting"
            assert time.monotonic() - started < 2.0
        assert server.pending <= 16


def test_a_flood_from_many_loopback_addresses_cannot_push_out_a_distant_owner(served):
    """Review of issue 40: 32 loopback addresses held a slot each, so the owner (behind a relay that
    delays each chunk, as a network does) took the oldest's slot and lost its own to the next
    newcomer before its hello crossed: it read an end of stream, RunGone, for a live run. Now all
    of loopback is one source, a newcomer takes a silent connection's slot drawn at random among
    the 16 (not the oldest: the owner's, by then), a connection that has spoken keeps its slot,
    one that loses it hears ``busy``, and the owner tries again."""
    server = served()
    flood_from = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(32)]
    with (
        Relay(server.address, delay=0.02) as relay,
        Flood(server.address, flood_from, 1, trickle=False) as flood,
    ):
        wait_until(
            lambda: flood.busy + flood.dropped > 20, what="the flood to churn (it takes its own slots)"
        )
        for _ in range(3):
            started = time.monotonic()
            owner = retry_unreachable(lambda: OwnerConnection(*relay.address, RUN, SECRET, timeout=5), 10.0)
            with owner:
                assert owner.status.state == "starting"
            assert time.monotonic() - started < 8.0
        assert server.pending <= 16


def test_a_flood_from_the_owners_own_address_cannot_keep_it_out(served):
    """Review of issue 40: 4 silent connections from 127.0.0.1, refilled at once, filled its cap and
    every owner from there heard ``busy`` until its retries ran out. Now, all slots held, a newcomer
    from a source at its cap takes one of that source's own silent connections' slots."""
    server = served()
    with Flood(server.address, ["127.0.0.1"], width=20, trickle=False):
        wait_until(lambda: server.pending == 16, what="the flood to hold every slot")
        for _ in range(3):
            started = time.monotonic()
            with retry_unreachable(
                lambda: OwnerConnection(*server.address, RUN, SECRET, timeout=5), 5.0
            ) as owner:
                assert owner.status.state == "starting"
            assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("client", ["sync", "async"])
@pytest.mark.parametrize("closes", ["before the challenge", "before the welcome"])
def test_a_connection_closed_mid_handshake_is_worth_another_try_not_a_gone_run(client, closes):
    """Review of issue 40: an end of stream before the challenge was RunGone (the task ended a live
    run as lost), before the welcome a LifelineError; a busy supervisor closes such connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def supervisor_that_closes() -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as reader:
            reader.readline()  # the hello
            if closes == "before the welcome":
                conn.sendall(b'{"nonce": "' + b"0" * 32 + b'"}\n')
                reader.readline()  # the proof

    answering = threading.Thread(target=supervisor_that_closes, daemon=True)
    answering.start()

    async def connect_async() -> None:
        await AsyncOwnerConnection.connect("127.0.0.1", port, RUN, SECRET, timeout=5)

    with pytest.raises(LifelineUnreachable, match=f"closed {closes}"):
        if client == "sync":
            OwnerConnection("127.0.0.1", port, RUN, SECRET, timeout=5)
        else:
            asyncio.run(connect_async())
    answering.join(5)
    listener.close()


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("127.0.0.1", "loopback"),
        ("127.45.0.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.3", "loopback"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
    ],
)
def test_sources_are_counted_by_host_prefix(address, source):
    assert slot_source(address) == source


def pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    made = [socket.socketpair() for _ in range(n)]
    for server_end, _ in made:
        server_end.settimeout(2)
    return made


def test_when_all_are_held_a_newcomer_from_a_source_at_its_cap_takes_one_of_its_own_silent_slots():
    conns = pairs(6)
    slots = HandshakeSlots(total=3, per_source=2, farewell=b'{"code": "busy"}\n')
    assert all(slots.admit("10.0.0.1", a) for a, _ in conns[:3])  # room: past its share of 2
    conns[0][1].sendall(b'{"v": 1,')  # part of a hello: after the silent ones
    assert slots.admit("10.0.0.1", conns[3][0]) and len(slots) == 3
    (taken,) = [i for i in (1, 2) if not slots.leave(conns[i][0])]  # a silent one's, not conns[0]'s
    assert conns[taken][1].recv(100) == b'{"code": "busy"}\n' and conns[taken][1].recv(100) == b""
    assert slots.leave(conns[0][0]) and len(slots) == 1  # conns[3] alone
    assert slots.admit("10.0.0.2", conns[4][0]) and len(slots) == 2  # another source: room
    for a, b in conns:
        a.close()
        b.close()


def test_one_source_keeps_at_most_its_share_of_hellos_out_of_reach():
    conns = pairs(3)
    slots = HandshakeSlots(total=16, per_source=2, farewell=b"busy\n")
    for server_end, client_end in conns:
        assert slots.admit("10.0.0.1", server_end)
        client_end.sendall(b'{"hello": 1}\n')
    for server_end, _ in conns[:2]:
        assert slots.hear_hello(server_end, time.monotonic() + 2, 4096) == b'{"hello": 1}\n'
    with pytest.raises(HelloRefused, match="as many hellos"):
        slots.hear_hello(conns[2][0], time.monotonic() + 2, 4096)
    assert conns[2][1].recv(100) == b"busy\n"
    for a, b in conns:
        a.close()
        b.close()


def test_a_connection_whose_hello_has_arrived_keeps_its_slot():
    conns = pairs(5)
    slots = HandshakeSlots(total=2, per_source=2)
    assert slots.admit("10.0.0.1", conns[0][0]) and slots.admit("10.0.0.1", conns[1][0])
    conns[0][1].sendall(b'{"hello": 1}\nmore')  # arrived in full, not read yet
    conns[1][1].sendall(b'{"hello": 2}\n')
    assert slots.hear_hello(conns[1][0], time.monotonic() + 2, 4096) == b'{"hello": 2}\n'
    assert not slots.admit("10.0.0.1", conns[2][0])  # both have spoken: the newcomer hears busy
    assert not slots.admit("10.0.0.2", conns[2][0])  # full, and nothing to take from anyone
    assert not slots.admit(None, conns[2][0])  # a local one never takes another's slot
    assert slots.hear_hello(conns[0][0], time.monotonic() + 2, 4096) == b'{"hello": 1}\n'
    assert conns[0][0].recv(10) == b"more"  # what follows the hello stays for the next reader
    for a, b in conns:
        a.close()
        b.close()


def test_when_all_slots_are_held_a_newcomer_takes_the_busiest_sources_oldest_silent_one():
    conns = pairs(7)
    slots = HandshakeSlots(total=4, per_source=3)
    assert all(slots.admit("10.0.0.1", a) for a, _ in conns[:3])
    assert slots.admit("10.0.0.2", conns[3][0]) and len(slots) == 4
    assert slots.admit("10.0.0.3", conns[4][0])  # full: one of the busiest source's makes room
    assert slots.admit("10.0.0.2", conns[5][0])  # 10.0.0.1 still holds more than 10.0.0.2
    assert [slots.leave(a) for a, _ in conns[:3]].count(False) == 2 and len(slots) == 3
    assert slots.admit("10.0.0.1", conns[0][0]) and len(slots) == 4
    assert not slots.admit("10.0.0.2", conns[6][0])  # it holds 2, no source more: busy
    for a, b in conns:
        a.close()
        b.close()


def test_an_owner_waiting_for_its_supervisors_first_answer_tries_again_while_it_is_busy(served, monkeypatch):
    """A flood of this user's own processes can hold every slot of a local lifeline for a moment:
    ``start_run`` (``connect_owner``) and ``run_state`` try again within their deadline."""
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "k" * 40)
    record = RunRecord(RUN, "127.0.0.1", 1, durable=False, reattach_timeout=30.0)
    server = LifelineServer(RUN, record.secret(), "127.0.0.1", RunState(), max_pending=1, line_timeout=1.0)
    server.start()
    try:
        record = RunRecord(RUN, *server.address, durable=False, reattach_timeout=30.0)
        squatter = socket.create_connection(server.address)  # holds the one slot for 1 s
        wait_until(lambda: server.pending == 1, what="the squatter's slot")
        with pytest.raises(LifelineUnreachable, match="too many connections"):
            query_status(*server.address, RUN, record.secret())  # one try: busy
        assert run_state(record) == "starting"  # tries again until the slot is free
        with connect_owner(record) as owner:
            assert owner.status.state == "starting"
        squatter.close()
    finally:
        server.close("test over", timeout=0.5)


# -- the local lifeline: a unix socket in a private directory ---------------------------------------


def private_dir(tmp_path: Path, name: str = "torchdist-x") -> Path:
    path = tmp_path / name
    path.mkdir(mode=0o700)
    return path


def test_a_loopback_lifeline_listens_on_a_unix_socket_in_the_private_staging_dir(served, tmp_path):
    staging = private_dir(tmp_path)
    bind, fallback = lifeline_bind("127.0.0.1", staging)
    assert (bind, fallback) == (unix_host(staging / "lifeline.sock"), None)
    server = served(bind)
    assert server.address == (bind, 0)
    info = (staging / "lifeline.sock").stat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    with OwnerConnection(*server.address, RUN, SECRET) as owner:
        assert owner.status.state == "starting"
    server.close("test over")
    assert not (staging / "lifeline.sock").exists()  # the run is gone: nothing to find
    assert lifeline_bind("10.1.2.3", staging) == ("10.1.2.3", None)  # not loopback: TCP


def test_a_trigger_follows_a_local_lifeline_too(served, tmp_path):
    server = served(unix_host(private_dir(tmp_path) / "lifeline.sock"))

    async def follow() -> str:
        conn = await AsyncOwnerConnection.connect(*server.address, RUN, SECRET, kind="trigger")
        try:
            return conn.status.state
        finally:
            await conn.close()

    assert asyncio.run(follow()) == "starting"
    (tmp_path / "torchdist-x").chmod(0o750)  # no longer private: refused before connecting
    with pytest.raises(UnsafeLifelineSocket, match="not in a private directory"):
        asyncio.run(follow())


def test_a_path_too_long_for_a_unix_socket_falls_back_to_tcp_and_says_so(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    bind, fallback = lifeline_bind("127.0.0.1", deep)
    assert bind == "127.0.0.1"
    assert fallback is not None and "too deep for a unix socket" in fallback and "TCP 127.0.0.1" in fallback
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)  # another user could swap the staging directory in there
    staging = private_dir(shared)
    bind, fallback = lifeline_bind("127.0.0.1", staging)
    assert bind == "127.0.0.1" and fallback is not None and "another user could swap" in fallback


@pytest.mark.parametrize("how", ["world-writable", "another user's", "under a writable dir"])
def test_a_record_naming_a_socket_outside_a_private_dir_is_refused(served, tmp_path, monkeypatch, how):
    """Whoever may edit a task's state must not point its owners (or the view) at a socket that
    another user could have made: a real server answers there, and is never asked."""
    if how == "under a writable dir":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        where = private_dir(shared)
    else:
        where = private_dir(tmp_path)
    server = served(unix_host(where / "lifeline.sock"))
    if how == "world-writable":
        where.chmod(0o777)
    elif how == "another user's":
        if os.getuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        os.chown(where, 65534, 65534)
    with pytest.raises(UnsafeLifelineSocket, match="private directory|another user could swap"):
        OwnerConnection(*server.address, RUN, SECRET)
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "k" * 40)
    record = RunRecord.from_dict(
        {
            **RunRecord(RUN, "127.0.0.1", 1, durable=True, reattach_timeout=30.0).to_dict(),
            "host": server.address[0],
            "port": 0,
        }
    )
    with pytest.raises(UnsafeLifelineSocket):  # refused, not taken for a run that is gone
        run_state(record)
    assert server.pending == 0  # nothing ever connected


def test_a_record_whose_socket_is_gone_is_a_gone_run(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "k" * 40)
    where = private_dir(tmp_path)
    record = RunRecord(RUN, unix_host(where / "lifeline.sock"), 0, durable=True, reattach_timeout=30.0)
    assert run_state(record) == GONE
    where.rmdir()  # the staging directory went with the teardown
    assert run_state(record) == GONE
    with pytest.raises(InvalidTrainingConfig, match="malformed"):
        RunRecord.from_dict({**record.to_dict(), "port": 0, "host": "127.0.0.1"})  # port 0 is unix only


def as_nobody(path: Path) -> str:
    """What a process of another user (nobody) gets when it connects to ``path``: a forked child
    that drops to uid 65534 and reports over a pipe (no interpreter to exec that nobody may run)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(str(path))
                answer = sock.recv(4096).decode().strip() or "closed"
            except OSError as exc:
                answer = type(exc).__name__
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.fixture
def open_dir():
    """A directory under the temp dir that another user can enter (pytest's own are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="torchdist-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@as_root
def test_another_user_cannot_connect_to_a_local_lifeline(served, open_dir):
    staging = private_dir(open_dir)
    served(unix_host(staging / "lifeline.sock"))
    assert as_nobody(staging / "lifeline.sock") == "PermissionError"
    # Even with the directory and the socket opened up, the supervisor turns another user away.
    staging.chmod(0o755)
    (staging / "lifeline.sock").chmod(0o666)
    answer = json.loads(as_nobody(staging / "lifeline.sock"))
    assert answer == {"error": "this lifeline is its user's only", "code": "refused"}
