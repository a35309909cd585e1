"""A network between an owner and its supervisor (issue 40): a real relay (a TCP proxy thread)
between a real :class:`OwnerConnection` and a real :class:`LifelineServer` passes the handshake
through unchanged and then rewrites, injects, replays, drops or cuts what follows. Every change is
refused: nothing the relay made up is taken for the supervisor's (or the owner's) word, and no
output it swapped in is fetched, let alone signed."""

from __future__ import annotations

import asyncio
import hashlib
import json
import pickle
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchdist.outputs.results import output_to_xcom
from airflow_provider_torchdist.spark.wire.output_store import FORMAT_PICKLE
from airflow_provider_torchdist.supervision.lifeline import (
    AsyncOwnerConnection,
    DoneEvent,
    LifelineError,
    LifelineServer,
    LineEvent,
    OwnerConnection,
    encode,
)
from tests.unit.conftest import wait_until
from tests.unit.supervision.test_lifeline import RUN, SECRET, Recorder, finished_with_output

#: What the relay does with one message after the handshake: the lines to forward instead (the
#: same line for none), or None to cut both connections.
Tamper = Callable[[int, bytes, dict[str, Any]], list[bytes] | None]
HANDSHAKE_LINES = 2  # each way: hello and proof up; challenge and welcome down


def _message(line: bytes) -> tuple[bytes, dict[str, Any]]:
    """A line's prefix (a sealed line's MAC and space; none for a plain line) and its message."""
    try:
        return b"", json.loads(line)
    except ValueError:
        prefix, _, rest = line.partition(b" ")
        return prefix + b" ", json.loads(rest)


def rewritten(line: bytes, msg: dict[str, Any]) -> bytes:
    """``line`` saying ``msg`` instead, its MAC (if it has one) kept as it was."""
    return _message(line)[0] + encode(msg)


class Relay:
    """Accepts one owner, connects it to ``target`` and pumps both ways: the handshake unchanged,
    then each message through ``down`` (supervisor to owner) or ``up`` (owner to supervisor).
    After a ``down`` output header, its raw bytes go through ``swap_bytes``."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        down: Tamper | None = None,
        up: Tamper | None = None,
        swap_bytes: Callable[[bytes], bytes] = lambda data: data,
    ) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._target, self._down, self._up, self._swap = target, down, up, swap_bytes
        self.seen_down: list[bytes] = []
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        owner, _ = self._listener.accept()
        supervisor = socket.create_connection(self._target)
        self._socks = [owner, supervisor]
        threading.Thread(target=self._pump, args=(supervisor, owner, self._down, True), daemon=True).start()
        self._pump(owner, supervisor, self._up, False)

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: Tamper | None, down: bool) -> None:
        reader = src.makefile("rb")
        try:
            for _ in range(HANDSHAKE_LINES):
                dst.sendall(reader.readline())
            index = 0
            while line := reader.readline():
                msg = _message(line)[1]
                out = [line] if tamper is None else tamper(index, line, dict(msg))
                if out is None:
                    return
                if down:
                    self.seen_down.append(line)
                dst.sendall(b"".join(out))
                index += 1
                if down and msg.get("k") == "output" and msg.get("manifest"):
                    # The raw bytes the supervisor's own header announced, swapped as a whole.
                    dst.sendall(self._swap(reader.read(msg["manifest"]["size"])))
        except OSError:
            pass
        finally:
            self.cut()

    def cut(self) -> None:
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.cut()
        self._listener.close()
        for sock in self._socks:
            sock.close()


@pytest.fixture
def server(tmp_path: Path):
    """A supervisor of a run that logged three lines and succeeded with a small output."""
    # A pickle ({1} is not JSON), as the attacker's is.
    state = finished_with_output(tmp_path, {"accuracy": 0.9, "tag": {1}}, ("one", "two", "three"))
    served = LifelineServer(RUN, SECRET, "127.0.0.1", state, Recorder())
    served.start()
    yield served
    served.close("test over", timeout=0.5)


@pytest.fixture
def relays():
    made: list[Relay] = []

    def relay(target: tuple[str, int], **kwargs: Any) -> Relay:
        made.append(Relay(target, **kwargs))
        return made[-1]

    yield relay
    for relay in made:
        relay.close()


class _Planted:
    """The attacker's object: unpickling it would create ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_relay_that_swaps_the_output_gets_nothing_fetched_or_signed(server, relays, tmp_path):
    """The proof of concept of issue 40: a relay rewrote ``done``'s manifest and the output bytes,
    and the task signed the attacker's pickle. Now the rewritten ``done`` fails its MAC."""
    evil = pickle.dumps(_Planted(str(tmp_path / "pwned")))
    evil_manifest = {"format": FORMAT_PICKLE, "type": "builtins.dict", "size": len(evil)}
    evil_manifest["sha256"] = hashlib.sha256(evil).hexdigest()

    def swap_manifest(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
        if msg.get("k") == "done":
            msg["status"]["output"] = evil_manifest
            return [rewritten(line, msg)]
        if msg.get("k") == "output":
            return [rewritten(line, {**msg, "manifest": evil_manifest})]
        return [line]

    relay = relays(server.address, down=swap_manifest, swap_bytes=lambda data: evil)
    dest = tmp_path / "dest"
    dest.mkdir()
    signed: list[Any] = []
    with OwnerConnection(*relay.address, RUN, SECRET) as owner:
        with pytest.raises(LifelineError, match="was tampered with"):
            path = owner.fetch_output(dest)  # the operator's path: fetch, then sign what came
            signed.append(
                output_to_xcom(
                    path,
                    origin={"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1, "try": 1},
                    max_inline_bytes=1 << 20,
                    store_uri=str(tmp_path / "store"),
                    key=b"k" * 32,
                )
            )
    assert signed == [] and list(dest.iterdir()) == []
    assert not (tmp_path / "pwned").exists()


def _lines(owner: OwnerConnection) -> tuple[list[Any], BaseException | None]:
    events: list[Any] = []
    try:
        for event in owner.events():
            events.append(event)
    except LifelineError as exc:
        return events, exc
    return events, None


def _forge_line(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
    forged = encode({"k": "line", "seq": 99, "text": "rm -rf: done, all good"})
    return [forged, line] if index == 1 else [line]


def _forge_done(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
    forged = {**msg, "status": {**msg.get("status", {}), "output": None}}
    return [rewritten(line, forged)] if msg.get("k") == "done" else [line]


def _replay_first(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
    return [line, line] if index == 0 else [line]


def _drop_second(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
    return [] if index == 1 else [line]


def _swap_order(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
    # The first two lines change places: "one" is held back and sent after "two".
    if index == 0:
        _swap_order.held = line  # type: ignore[attr-defined]
        return []
    return [line, _swap_order.held] if index == 1 else [line]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "tamper", [_forge_line, _forge_done, _replay_first, _drop_second, _swap_order], ids=lambda t: t.__name__
)
def test_a_relay_that_changes_the_stream_is_refused(server, relays, tamper):
    relay = relays(server.address, down=tamper)
    with OwnerConnection(*relay.address, RUN, SECRET) as owner:
        events, error = _lines(owner)
        assert owner.done is None  # no "done" but the supervisor's
    assert error is not None and "was tampered with" in str(error)
    # What came before the change is the supervisor's own; nothing after it was taken.
    assert all(isinstance(e, LineEvent) and e.text in ("one", "two", "three") for e in events)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


def test_the_triggers_async_client_refuses_a_forged_done_too(server, relays):
    relay = relays(server.address, down=_forge_done)

    async def follow() -> list[Any]:
        conn = await AsyncOwnerConnection.connect(*relay.address, RUN, SECRET)
        seen: list[Any] = []
        try:
            with pytest.raises(LifelineError, match="was tampered with"):
                async for event in conn.events():
                    seen.append(event)
        finally:
            await conn.close()
        return seen

    assert [e.text for e in asyncio.run(follow())] == ["one", "two", "three"]


def test_a_message_of_another_session_is_refused(server, relays):
    """Nonces differ per session, so do the keys: a message recorded once is no good later."""
    recorder = relays(server.address)
    with OwnerConnection(*recorder.address, RUN, SECRET) as owner:
        assert _lines(owner)[1] is None
    recorded = recorder.seen_down
    assert len(recorded) == 4  # three lines and done

    def from_before(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
        # The same message, at the same place, of the earlier session.
        return [recorded[index] if index < len(recorded) else line]

    relay = relays(server.address, down=from_before)
    with OwnerConnection(*relay.address, RUN, SECRET) as owner:
        events, error = _lines(owner)
    assert events == [] and error is not None and "was tampered with" in str(error)


def test_a_stream_cut_before_done_is_a_broken_lifeline_not_an_end(server, relays, tmp_path):
    relay = relays(server.address, down=lambda index, line, msg: None if index == 2 else [line])
    with OwnerConnection(*relay.address, RUN, SECRET) as owner:
        events, error = _lines(owner)
        assert owner.done is None
        with pytest.raises(LifelineError):
            owner.fetch_output(tmp_path)
    assert [e.text for e in events] == ["one", "two"]
    assert error is not None and "closed the lifeline before the run ended" in str(error)
    assert not any(isinstance(e, DoneEvent) for e in events)


def test_a_relay_that_turns_detach_into_stop_is_refused_by_the_supervisor(server, relays):
    def detach_to_stop(index: int, line: bytes, msg: dict[str, Any]) -> list[bytes]:
        return [rewritten(line, {"k": "stop"})] if msg.get("k") == "detach" else [line]

    listener = server.listener
    relay = relays(server.address, up=detach_to_stop)
    with OwnerConnection(*relay.address, RUN, SECRET) as owner:
        owner.detach()
        wait_until(lambda: listener.lost, what="the supervisor ends the tampered session")
    assert listener.commands == []  # neither stop nor detach: nothing from that session is obeyed
    assert "was tampered with" in listener.lost[0][1]


# -- the seal itself ---------------------------------------------------------------------------------


def test_a_sealed_stream_opens_in_order_only_and_not_reflected_or_elsewhere():
    from airflow_provider_torchdist.supervision.lifeline.sealed import (
        OWNER_TO_SUPERVISOR,
        SUPERVISOR_TO_OWNER,
        Opener,
        Sealer,
        StreamTampered,
        session_keys,
    )

    keys = session_keys(SECRET, RUN, "a" * 32, "b" * 32)
    assert keys[OWNER_TO_SUPERVISOR] != keys[SUPERVISOR_TO_OWNER]
    assert session_keys(SECRET, RUN, "a" * 32, "c" * 32) != keys  # another session, other keys
    sealer = Sealer(keys[SUPERVISOR_TO_OWNER])
    first, second = (sealer.seal_message({"k": "line", "seq": n, "text": "x"}) for n in (1, 2))

    opener = Opener(keys[SUPERVISOR_TO_OWNER], "the supervisor")
    assert opener.open(first)["seq"] == 1 and opener.open(second)["seq"] == 2

    def refused(opener: Opener, *lines: bytes) -> None:
        with pytest.raises(StreamTampered, match="the supervisor was tampered with"):
            for line in lines:
                opener.open(line)

    refused(Opener(keys[SUPERVISOR_TO_OWNER], "the supervisor"), second)  # reordered (or dropped)
    refused(Opener(keys[SUPERVISOR_TO_OWNER], "the supervisor"), first, first)  # replayed
    refused(Opener(keys[OWNER_TO_SUPERVISOR], "the supervisor"), first)  # reflected to its sender
    refused(Opener(keys[SUPERVISOR_TO_OWNER], "the supervisor"), encode({"k": "ping"}))  # not sealed
    broken = Opener(keys[SUPERVISOR_TO_OWNER], "the supervisor")
    refused(broken, second)
    refused(broken, first)  # once tampered with, never trusted again
