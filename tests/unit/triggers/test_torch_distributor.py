"""TorchDistributorTrigger against a scripted lifeline: kwargs, events, backoff, reconnect, kill, cleanup.

``AsyncOwnerConnection`` is replaced by :class:`FakeLifeline`: each ``connect`` takes the next step
of a script (an exception to raise, or a :class:`FakeConnection` with a status and the events it
streams), so no socket is opened. The waits between reconnection attempts run on a fake clock.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.supervision.lifeline import (
    AppEvent,
    DoneEvent,
    LifelineError,
    LifelineServer,
    LifelineUnreachable,
    LineEvent,
    MetricEvent,
    OwnerSession,
    RunGone,
    RunState,
    RunStatus,
)
from airflow_provider_torchdist.supervision.record import RunRecord
from airflow_provider_torchdist.triggers import torch_distributor as trigger_module
from airflow_provider_torchdist.triggers.torch_distributor import TorchDistributorTrigger
from tests.unit.conftest import wait_until

#: A step of a FakeConnection's event stream that never ends (a run still training).
HANG = "hang"


def make_record(reattach_timeout: float = 600.0) -> dict[str, Any]:
    return RunRecord(
        run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=reattach_timeout
    ).to_dict()


def status(state: str, last_seq: int = 0, **fields: Any) -> RunStatus:
    values = {
        "app_id": "app-1",
        "ui_url": None,
        "error": None,
        "failures": [],
        "metrics": [],
        "output": None,
        "last_seq": last_seq,
    }
    return RunStatus(state=state, **(values | fields))


SUCCEEDED = status(
    "succeeded",
    last_seq=3,
    metrics=[{"rank": 0, "step": 0, "loss": 0.5}],
    output={"format": "pickle", "type": "dict", "size": 10, "sha256": "ab"},
)


class FakeConnection:
    """One authenticated lifeline: its status at connect, then the events it streams; once stopped,
    what a new iteration streams is ``after_stop`` (a stopping run's lines, its end), which ends
    there."""

    def __init__(self, at_connect: RunStatus, events: list[Any], after_stop: list[Any] | None = None) -> None:
        self.status = at_connect
        self._events = events
        self.after_stop = after_stop or []
        self.calls: list[str] = []
        self.whys: list[str | None] = []
        self.iterating = asyncio.Event()

    async def events(self) -> AsyncIterator[Any]:
        self.iterating.set()
        for item in self.after_stop if "stop" in self.calls else self._events:
            if isinstance(item, BaseException):
                raise item
            if item == HANG:
                await asyncio.Event().wait()
            yield item

    async def stop(self, why: str | None = None) -> None:
        self.calls.append("stop")
        self.whys.append(why)

    async def detach(self) -> None:
        self.calls.append("detach")

    async def release(self) -> None:
        self.calls.append("release")

    async def close(self) -> None:
        self.calls.append("close")


class FakeLifeline:
    """Stands in for ``AsyncOwnerConnection``: ``connect`` plays ``script``, then raises RunGone."""

    script: list[FakeConnection | BaseException] = []
    connects: list[dict[str, Any]] = []

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        run_id: str,
        secret: bytes,
        *,
        kind: str = "trigger",
        since: int = 0,
        timeout: float = 10.0,
    ) -> FakeConnection:
        cls.connects.append(
            {"host": host, "port": port, "run_id": run_id, "secret": secret, "kind": kind, "since": since}
        )
        step = cls.script.pop(0) if cls.script else RunGone("connection refused")
        if isinstance(step, BaseException):
            raise step
        return step


@pytest.fixture
def lifeline(monkeypatch: pytest.MonkeyPatch) -> type[FakeLifeline]:
    monkeypatch.setattr(FakeLifeline, "script", [])
    monkeypatch.setattr(FakeLifeline, "connects", [])
    monkeypatch.setattr(trigger_module, "AsyncOwnerConnection", FakeLifeline)
    monkeypatch.setattr(
        trigger_module, "owner_secret", lambda run_id, key=None, task=None: b"secret-of-" + run_id.encode()
    )
    return FakeLifeline


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the trigger asks for between connection attempts, on a clock of the trigger's own
    that only they move: what it asks for does not depend on how loaded the machine is."""
    asked: list[float] = []
    real_sleep = asyncio.sleep
    clock = [1000.0]

    async def recording_sleep(delay: float, *args: Any) -> Any:
        asked.append(delay)
        clock[0] += delay
        return await real_sleep(0, *args)

    monkeypatch.setattr(trigger_module.asyncio, "sleep", recording_sleep)
    monkeypatch.setattr(trigger_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    return asked


def import_string(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


async def collect(trigger: TorchDistributorTrigger) -> list[dict[str, Any]]:
    return [event.payload async for event in trigger.run()]


def events_of(trigger: TorchDistributorTrigger, timeout: float = 10.0) -> list[dict[str, Any]]:
    return asyncio.run(asyncio.wait_for(collect(trigger), timeout))


# -- kwargs ---------------------------------------------------------------------------------------


def test_serialize_round_trips_through_json() -> None:
    trigger = TorchDistributorTrigger(make_record(), poll_interval=2)
    classpath, kwargs = trigger.serialize()

    assert classpath == "airflow_provider_torchdist.triggers.torch_distributor.TorchDistributorTrigger"
    assert import_string(classpath) is TorchDistributorTrigger
    assert kwargs == {"record": make_record(), "poll_interval": 2.0, "task_binding": None}
    again = import_string(classpath)(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)


def test_the_task_binding_round_trips_and_is_what_the_credential_is_derived_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_provider_torchdist.supervision.record import TaskBinding

    binding = TaskBinding("dag", "manual__1", "train", 2)
    trigger = TorchDistributorTrigger(make_record(), task_binding=binding)
    classpath, kwargs = trigger.serialize()
    assert kwargs["task_binding"] == {
        "dag_id": "dag",
        "run_id": "manual__1",
        "task_id": "train",
        "map_index": 2,
    }
    again = import_string(classpath)(**json.loads(json.dumps(kwargs)))
    asked: list[object] = []
    monkeypatch.setattr(
        trigger_module, "owner_secret", lambda run_id, key=None, task=None: asked.append(task) or b"s" * 32
    )
    asyncio.run(again._owner_secret())
    assert asked == [binding]
    with pytest.raises(InvalidTrainingConfig, match="task_binding"):
        TorchDistributorTrigger(make_record(), task_binding={"dag_id": "dag"})


@pytest.mark.parametrize(
    "record",
    [
        {"run_id": "run-1", "host": "127.0.0.1"},  # fields missing
        make_record() | {"version": 99},  # written by another provider version
        make_record() | {"port": 0},
        make_record() | {"reattach_timeout": -1},
        "not a dict",
    ],
)
def test_bad_record_is_refused(record: Any) -> None:
    with pytest.raises(InvalidTrainingConfig):
        TorchDistributorTrigger(record)


@pytest.mark.parametrize("poll_interval", [0, -1.0, float("nan"), float("inf"), True, "5", None])
def test_bad_poll_interval_is_refused(poll_interval: Any) -> None:
    with pytest.raises(InvalidTrainingConfig, match="poll_interval"):
        TorchDistributorTrigger(make_record(), poll_interval=poll_interval)


# -- run ------------------------------------------------------------------------------------------


def test_done_fires_one_event_after_detaching(lifeline: type[FakeLifeline]) -> None:
    connection = FakeConnection(
        status("running"),
        [
            LineEvent(1, "before-gate rank 0"),
            AppEvent("app-1", "http://driver:4040"),
            MetricEvent({"rank": 0, "step": 0, "loss": 0.5}),
            DoneEvent(SUCCEEDED),
        ],
    )
    lifeline.script = [connection]

    events = events_of(TorchDistributorTrigger(make_record()))

    assert events == [{"state": "succeeded", "record": make_record(), "status": SUCCEEDED.to_dict()}]
    json.dumps(events)  # the triggerer stores the payload
    # Left on purpose, not released: execute_complete takes the result next.
    assert connection.calls == ["detach", "close"]
    assert [(c["kind"], c["secret"]) for c in lifeline.connects] == [("trigger", b"secret-of-run-1")]


def test_run_already_ended_at_connect(lifeline: type[FakeLifeline]) -> None:
    failed = status("failed", error="rank 1 exited with code 1")
    connection = FakeConnection(failed, [HANG])  # no event would come: the status says it all
    lifeline.script = [connection]

    events = events_of(TorchDistributorTrigger(make_record()))

    assert [e["state"] for e in events] == ["failed"]
    assert events[0]["status"]["error"] == "rank 1 exited with code 1"
    assert not connection.iterating.is_set()
    assert connection.calls == ["detach", "close"]


def test_backoff_doubles_then_gone_after_reattach_timeout(
    lifeline: type[FakeLifeline], sleeps: list[float]
) -> None:
    trigger = TorchDistributorTrigger(make_record(reattach_timeout=0.5), poll_interval=0.02)

    events = events_of(trigger)

    assert [e["state"] for e in events] == ["gone"]
    assert "run-1" in events[0]["message"] and "127.0.0.1:40123" in events[0]["message"]
    assert events[0]["record"] == make_record(reattach_timeout=0.5)
    assert sleeps[:3] == pytest.approx([0.02, 0.04, 0.08])
    # The last wait is cut to what is left of reattach_timeout, counted from the first failure.
    assert sum(sleeps) == pytest.approx(0.5)
    assert len(lifeline.connects) == len(sleeps) + 1


def test_backoff_is_capped(
    lifeline: type[FakeLifeline], sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trigger_module, "MAX_BACKOFF_S", 0.05)

    events_of(TorchDistributorTrigger(make_record(reattach_timeout=0.4), poll_interval=0.02))

    assert sleeps[:4] == pytest.approx([0.02, 0.04, 0.05, 0.05])
    assert max(sleeps) == pytest.approx(0.05)


def test_connects_after_a_few_refusals(lifeline: type[FakeLifeline], sleeps: list[float]) -> None:
    """A supervisor not answering for a moment is not a lost run."""
    connection = FakeConnection(status("running"), [DoneEvent(SUCCEEDED)])
    lifeline.script = [
        RunGone("refused"),
        LifelineUnreachable("no route to host"),
        RunGone("refused"),
        connection,
    ]

    events = events_of(TorchDistributorTrigger(make_record(), poll_interval=0.01))

    assert [e["state"] for e in events] == ["succeeded"]
    assert sleeps == pytest.approx([0.01, 0.02, 0.04])


def test_reconnects_after_a_mid_run_drop(lifeline: type[FakeLifeline], sleeps: list[float]) -> None:
    dropped = FakeConnection(
        status("running", last_seq=1),
        [LineEvent(2, "before-gate rank 0"), LineEvent(3, "before-gate rank 1"), LifelineError("closed")],
    )
    second = FakeConnection(status("running", last_seq=5), [LineEvent(6, "after-gate"), DoneEvent(SUCCEEDED)])
    lifeline.script = [dropped, RunGone("refused while the network is down"), second]

    events = events_of(TorchDistributorTrigger(make_record(), poll_interval=0.01))

    assert [e["state"] for e in events] == ["succeeded"]
    assert dropped.calls == ["close"]  # neither stopped nor detached: the run waits for the next owner
    assert second.calls == ["detach", "close"]
    # No replay of lines the trigger already saw.
    assert [c["since"] for c in lifeline.connects] == [0, 3, 3]
    assert sleeps == pytest.approx([0.01])


def test_stream_ending_without_done_reconnects(lifeline: type[FakeLifeline]) -> None:
    first = FakeConnection(status("running"), [])
    lifeline.script = [first, FakeConnection(status("running"), [DoneEvent(SUCCEEDED)])]

    events = events_of(TorchDistributorTrigger(make_record()))

    assert [e["state"] for e in events] == ["succeeded"]
    assert first.calls == ["close"]


def test_drop_then_no_supervisor_is_gone(lifeline: type[FakeLifeline]) -> None:
    lifeline.script = [FakeConnection(status("running"), [LifelineError("closed")])]

    events = events_of(TorchDistributorTrigger(make_record(reattach_timeout=0.1), poll_interval=0.01))

    assert [e["state"] for e in events] == ["gone"]


def test_refused_credential_is_an_error_at_once(lifeline: type[FakeLifeline], sleeps: list[float]) -> None:
    lifeline.script = [LifelineError("the supervisor refused the owner proof")]

    events = events_of(TorchDistributorTrigger(make_record()))

    assert [e["state"] for e in events] == ["error"]
    assert "refused the owner proof" in events[0]["message"]
    assert "output_signing_key" in events[0]["message"]
    assert len(lifeline.connects) == 1 and sleeps == []


def test_an_unexpected_failure_is_an_error_event_with_the_record(lifeline: type[FakeLifeline]) -> None:
    # Not a bare traceback: the task gets the record back and stops the run (execute_complete).
    lifeline.script = [FakeConnection(status("running"), [RuntimeError("decoder bug")])]

    events = events_of(TorchDistributorTrigger(make_record()))

    assert [e["state"] for e in events] == ["error"]
    assert "RuntimeError: decoder bug" in events[0]["message"]
    assert events[0]["record"] == make_record()


def test_no_signing_key_is_an_error(lifeline: type[FakeLifeline], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_key(run_id: str, key: object = None, task: object = None) -> bytes:
        raise ValueError("The output signing key has 3 bytes; it needs at least 32.")

    monkeypatch.setattr(trigger_module, "owner_secret", no_key)

    events = events_of(TorchDistributorTrigger(make_record()))

    assert [e["state"] for e in events] == ["error"]
    assert "output_signing_key" in events[0]["message"] and "3 bytes" in events[0]["message"]
    assert lifeline.connects == []


# -- on_kill and cleanup --------------------------------------------------------------------------


async def _cancel_while_training(trigger: TorchDistributorTrigger, connection: FakeConnection) -> None:
    """Run the trigger until it waits for events, then cancel it as the triggerer does."""

    async def consume() -> None:
        async for _ in trigger.run():
            pytest.fail("no event expected")

    task = asyncio.create_task(consume())
    await asyncio.wait_for(connection.iterating.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_on_kill_stops_the_run_on_the_open_lifeline(lifeline: type[FakeLifeline]) -> None:
    connection = FakeConnection(status("running"), [HANG])
    lifeline.script = [connection]
    trigger = TorchDistributorTrigger(make_record())

    async def scenario() -> None:
        await _cancel_while_training(trigger, connection)
        await trigger.on_kill()
        await trigger.cleanup()

    asyncio.run(scenario())

    assert connection.calls == ["stop", "close"]
    assert connection.whys == ["killed"]
    assert len(lifeline.connects) == 1


def test_on_kill_connects_to_stop_when_not_connected(lifeline: type[FakeLifeline]) -> None:
    connection = FakeConnection(status("running"), [])
    lifeline.script = [connection]

    asyncio.run(TorchDistributorTrigger(make_record()).on_kill())

    assert connection.calls == ["stop", "close"]
    assert [c["kind"] for c in lifeline.connects] == ["trigger"]


def test_on_kill_retries_stop_on_a_new_lifeline_when_the_open_one_dropped(
    lifeline: type[FakeLifeline],
) -> None:
    class Dropped(FakeConnection):
        async def stop(self, why: str | None = None) -> None:
            self.calls.append("stop")
            raise LifelineError("connection reset")

    dropped = Dropped(status("running"), [HANG])
    fresh = FakeConnection(status("running"), [])
    lifeline.script = [dropped, fresh]
    trigger = TorchDistributorTrigger(make_record())

    async def scenario() -> None:
        await _cancel_while_training(trigger, dropped)
        await trigger.on_kill()

    asyncio.run(scenario())

    assert dropped.calls == ["stop", "close"]
    assert fresh.calls == ["stop", "close"]


def test_on_kill_of_an_ended_run_does_nothing(lifeline: type[FakeLifeline]) -> None:
    asyncio.run(TorchDistributorTrigger(make_record()).on_kill())  # RunGone: nothing to stop

    assert len(lifeline.connects) == 1


def test_cleanup_closes_without_stopping(lifeline: type[FakeLifeline]) -> None:
    """A triggerer restart cancels the trigger and cleans up: the run must go on."""
    connection = FakeConnection(status("running"), [HANG])
    lifeline.script = [connection]
    trigger = TorchDistributorTrigger(make_record())

    async def scenario() -> None:
        await _cancel_while_training(trigger, connection)
        await trigger.cleanup()
        await trigger.cleanup()  # twice is harmless

    asyncio.run(scenario())

    assert connection.calls == ["close"]


# -- against a real lifeline server ----------------------------------------------------------------

SECRET = b"s" * 32


class RecordingOwners:
    """The supervisor's side as a log: who attached, which commands came, who left."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.attached = threading.Event()

    def owner_attached(self, owner: OwnerSession) -> None:
        self.seen.append(f"attached {owner.kind}")
        self.attached.set()

    def owner_command(self, owner: OwnerSession, command: str, why: str | None = None) -> str | None:
        self.seen.append(command if why is None else f"{command} ({why})")
        return None

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        self.seen.append("lost")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LifelineServer, RecordingOwners]]:
    owners = RecordingOwners()
    server = LifelineServer("run-1", SECRET, "127.0.0.1", RunState(), owners)
    server.start()
    monkeypatch.setattr(trigger_module, "owner_secret", lambda run_id, key=None, task=None: SECRET)
    yield server, owners
    server.close("test over")


def served_record(server: LifelineServer, reattach_timeout: float = 600.0) -> dict[str, Any]:
    host, port = server.address
    return make_record(reattach_timeout) | {"host": host, "port": port}


def test_real_lifeline_run_to_done(server: tuple[LifelineServer, RecordingOwners]) -> None:
    lifeline_server, owners = server
    state = lifeline_server.state
    state.set_running()
    state.add_line("before-gate rank 0")
    trigger = TorchDistributorTrigger(served_record(lifeline_server))

    async def scenario() -> list[dict[str, Any]]:
        events = asyncio.create_task(collect(trigger))
        await asyncio.to_thread(owners.attached.wait, 5)
        state.set_application("app-1", "http://127.0.0.1:4040")
        state.add_metric({"rank": 0, "step": 0, "loss": 0.5})
        state.finish("succeeded", metrics=[{"rank": 0, "step": 0, "loss": 0.5}])
        return await asyncio.wait_for(events, 10)

    events = asyncio.run(scenario())

    assert [e["state"] for e in events] == ["succeeded"]
    assert events[0]["status"]["metrics"] == [{"rank": 0, "step": 0, "loss": 0.5}]
    assert events[0]["status"]["app_id"] == "app-1"
    wait_until(lambda: "lost" in owners.seen, what="the owner to leave")
    assert owners.seen == ["attached trigger", "detach", "lost"]


def test_a_connect_runs_operation_joins_the_record_the_trigger_hands_back(
    server: tuple[LifelineServer, RecordingOwners],
) -> None:
    lifeline_server, owners = server
    state = lifeline_server.state
    state.set_running()
    operation = "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"
    trigger = TorchDistributorTrigger(served_record(lifeline_server))

    async def scenario() -> list[dict[str, Any]]:
        events = asyncio.create_task(collect(trigger))
        await asyncio.to_thread(owners.attached.wait, 5)
        state.set_application("app-1", None, operation)
        state.finish("failed", error="boom")
        return await asyncio.wait_for(events, 10)

    (event,) = asyncio.run(scenario())
    assert RunRecord.from_dict(event["record"]).connect_operation == operation
    assert trigger.serialize()[1]["record"]["connect_operation_id"] == operation.split("/")[1]


def test_real_lifeline_on_kill_stops(server: tuple[LifelineServer, RecordingOwners]) -> None:
    lifeline_server, owners = server
    lifeline_server.state.set_running()
    trigger = TorchDistributorTrigger(served_record(lifeline_server))

    async def scenario() -> None:
        task = asyncio.create_task(collect(trigger))
        await asyncio.to_thread(owners.attached.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await trigger.on_kill()
        await trigger.cleanup()

    asyncio.run(scenario())

    wait_until(
        lambda: owners.seen[-2:] == ["stop (killed)", "lost"], what="the stop, then the owner to leave"
    )
    # The cancelled wait may close its connection before on_kill speaks: on_kill then stops the run
    # over a new one (both orders are races the trigger must win). The ranks are told "killed".
    assert owners.seen in (
        ["attached trigger", "stop (killed)", "lost"],
        ["attached trigger", "lost", "attached trigger", "stop (killed)", "lost"],
    )


def test_real_lifeline_cleanup_leaves_without_a_command(
    server: tuple[LifelineServer, RecordingOwners],
) -> None:
    lifeline_server, owners = server
    lifeline_server.state.set_running()
    trigger = TorchDistributorTrigger(served_record(lifeline_server))

    async def scenario() -> None:
        task = asyncio.create_task(collect(trigger))
        await asyncio.to_thread(owners.attached.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await trigger.cleanup()

    asyncio.run(scenario())

    wait_until(lambda: "lost" in owners.seen, what="the owner to leave")
    assert owners.seen == ["attached trigger", "lost"]


def test_real_lifeline_wrong_key_is_an_error(
    server: tuple[LifelineServer, RecordingOwners], monkeypatch: pytest.MonkeyPatch
) -> None:
    lifeline_server, owners = server
    monkeypatch.setattr(trigger_module, "owner_secret", lambda run_id, key=None, task=None: b"x" * 32)

    events = events_of(TorchDistributorTrigger(served_record(lifeline_server)))

    assert [e["state"] for e in events] == ["error"]
    assert "output_signing_key" in events[0]["message"]
    assert owners.seen == []


def test_real_lifeline_torn_down_is_gone(server: tuple[LifelineServer, RecordingOwners]) -> None:
    lifeline_server, _ = server
    record = served_record(lifeline_server, reattach_timeout=0.2)
    lifeline_server.stop_accepting()  # the supervisor tore the run down: connection refused

    events = events_of(TorchDistributorTrigger(record, poll_interval=0.05))

    assert [e["state"] for e in events] == ["gone"]
    assert "torn down" in events[0]["message"]


# -- the task's execution_timeout while deferred (the record's deadline) ---------------------------


def test_at_the_records_deadline_the_run_is_stopped_and_the_event_is_timeout(
    lifeline: type[FakeLifeline],
) -> None:
    import time

    connection = FakeConnection(status("running"), [HANG])
    lifeline.script = [connection]
    trigger = TorchDistributorTrigger(make_record() | {"deadline": time.time() + 0.5})

    started = time.monotonic()
    events = events_of(trigger)

    assert 0.4 < time.monotonic() - started < 5
    assert [e["state"] for e in events] == ["timeout"]
    assert "run-1 passed the task's execution_timeout while the task was deferred" in events[0]["message"]
    assert events[0]["record"]["deadline"] == trigger.record["deadline"]
    assert connection.calls[0] == "stop"  # the run is stopped, not left to wait for an owner
    assert connection.whys == ["timeout"]  # its ranks are told why
    assert events[0]["stop_report"] == ""  # the fake lifeline closed with no end seen


def test_a_deadline_stop_is_followed_into_the_log_and_the_event_says_how_it_went(
    lifeline: type[FakeLifeline], capsys: pytest.CaptureFixture[str]
) -> None:
    """The task log shows the stop: the supervisor's lines while the run stops, and its end."""
    import time

    ended = status("failed", error="stopped (timeout); the ranks ended 1.2 s after the stop request")
    connection = FakeConnection(
        status("running"),
        [LineEvent(1, "rank 0 at step 3"), HANG],
        after_stop=[
            LineEvent(2, "[torchdist] stop requested (timeout): ranks have 10 s to checkpoint"),
            LineEvent(3, "[torchdist] the run ended 1.2 s after the stop request"),
            DoneEvent(ended),
        ],
    )
    lifeline.script = [connection]

    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() + 0.3}))

    assert [e["state"] for e in events] == ["timeout"]
    assert events[0]["stop_report"] == ended.error
    logged = capsys.readouterr().out  # (the trigger's log: structlog, to stdout here)
    assert "stop requested (timeout): ranks have 10 s to checkpoint" in logged
    assert "the run ended 1.2 s after the stop request" in logged
    assert connection.calls == ["stop", "close"]


def test_a_stopped_runs_long_error_is_cut_in_the_event(lifeline: type[FakeLifeline]) -> None:
    import time

    ended = status("failed", error="x" * 10_000)
    connection = FakeConnection(status("running"), [HANG], after_stop=[DoneEvent(ended)])
    lifeline.script = [connection]
    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() + 0.2}))
    assert events[0]["stop_report"] == "x" * trigger_module.MAX_REPORT_CHARS


def test_a_stop_still_going_at_the_bound_is_reported_as_such(
    lifeline: type[FakeLifeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setattr(trigger_module, "STOP_WAIT_S", 0.3)
    connection = FakeConnection(status("running"), [HANG], after_stop=[HANG])
    lifeline.script = [connection]

    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() + 0.2}), timeout=5)

    assert events[0]["stop_report"] == "the run was still stopping 0.3 s after the stop request"
    assert connection.calls[-1] == "close"


def test_a_run_that_ends_before_its_deadline_is_not_stopped(lifeline: type[FakeLifeline]) -> None:
    import time

    connection = FakeConnection(status("running"), [DoneEvent(SUCCEEDED)])
    lifeline.script = [connection]

    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() + 60}))

    assert [e["state"] for e in events] == ["succeeded"]
    assert "stop" not in connection.calls


def test_a_deadline_already_past_stops_the_run_at_once(lifeline: type[FakeLifeline]) -> None:
    import time

    connection = FakeConnection(status("running"), [HANG])
    lifeline.script = [connection]
    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() - 1}), timeout=5)
    assert [e["state"] for e in events] == ["timeout"]
    assert "stop" in connection.calls


def test_real_lifeline_deadline_stops_the_run(server: tuple[LifelineServer, RecordingOwners]) -> None:
    import time

    lifeline_server, owners = server
    lifeline_server.state.set_running()
    trigger = TorchDistributorTrigger(served_record(lifeline_server) | {"deadline": time.time() + 1.0})

    def stop_it() -> None:  # the supervisor's side of a stop: its line, then the run's end
        wait_until(lambda: "stop (timeout)" in owners.seen, what="the supervisor to be told to stop")
        lifeline_server.state.add_line("[torchdist] stop requested (timeout): ranks have 10 s to checkpoint")
        lifeline_server.state.finish(
            "failed", error="stopped (timeout); the ranks ended 0.4 s after the stop request"
        )

    stopper = threading.Thread(target=stop_it)
    stopper.start()
    events = events_of(trigger)
    stopper.join()

    assert [e["state"] for e in events] == ["timeout"]
    assert events[0]["stop_report"] == "stopped (timeout); the ranks ended 0.4 s after the stop request"


def test_cancelling_a_trigger_with_a_deadline_cancels_its_wait(lifeline: type[FakeLifeline]) -> None:
    """The triggerer cancels a trigger (a user's action, a move to another triggerer): nothing of
    it may go on waiting for, or reconnecting to, the run."""
    import time

    connection = FakeConnection(status("running"), [HANG])
    lifeline.script = [connection]
    trigger = TorchDistributorTrigger(make_record() | {"deadline": time.time() + 60})

    async def scenario() -> set[asyncio.Task[Any]]:
        task = asyncio.create_task(collect(trigger))
        await asyncio.wait_for(connection.iterating.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert asyncio.run(scenario()) == set()
    assert "stop" not in connection.calls  # a cancel is not a timeout
    assert len(lifeline.connects) == 1


def test_a_run_that_ended_as_its_deadline_passed_keeps_its_result(
    lifeline: type[FakeLifeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    class SlowDetach(FakeConnection):
        async def detach(self) -> None:  # the deadline passes while the trigger leaves the ended run
            await asyncio.sleep(5)

    connection = SlowDetach(status("running"), [DoneEvent(SUCCEEDED)])
    lifeline.script = [connection]
    events = events_of(TorchDistributorTrigger(make_record() | {"deadline": time.time() + 0.5}))
    assert [e["state"] for e in events] == ["succeeded"]
    assert "stop" not in connection.calls
