"""The lifeline host allow-list on the task side (issue 40): a run record names the address its
owners connect to, and whoever may edit a task's state may write one. The task, a retry and the
trigger connect only to ``[torchdist] lifeline_host`` and ``[torchdist] view_lifeline_hosts``, as the
Training view does; these tests point real clients at a real listener outside the list."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from airflow_provider_torchdist.supervision.lifeline_hosts import (
    LifelineHostRefused,
    check_lifeline_address,
    lifeline_address_allowed,
)
from airflow_provider_torchdist.supervision.record import RunRecord
from airflow_provider_torchdist.supervision.task_side import connect_owner, run_state
from airflow_provider_torchdist.triggers.torch_distributor import TorchDistributorTrigger


@pytest.fixture(autouse=True)
def deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "k" * 40)
    monkeypatch.setenv("AIRFLOW__TORCHDIST__LIFELINE_HOST", "127.0.0.1")
    monkeypatch.delenv("AIRFLOW__TORCHDIST__VIEW_LIFELINE_HOSTS", raising=False)


@pytest.fixture
def elsewhere() -> Iterator[socket.socket]:
    """A listener on 127.0.0.2 (loopback, but not a lifeline host here): where an edited record
    points. Non-blocking, so that ``accept`` says at once whether anything connected."""
    listener = socket.create_server(("127.0.0.2", 0))
    listener.setblocking(False)
    yield listener
    listener.close()


def record_at(listener: socket.socket) -> RunRecord:
    host, port = listener.getsockname()[:2]
    return RunRecord(run_id="run-1", host=host, port=port, durable=True, reattach_timeout=600.0)


def nobody_connected(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def test_the_allow_list_is_the_configured_hosts_their_addresses_and_local_sockets(monkeypatch):
    assert lifeline_address_allowed("127.0.0.1")
    assert not lifeline_address_allowed("127.0.0.2")
    assert not lifeline_address_allowed("attacker.example")
    assert lifeline_address_allowed("unix:/tmp/x/lifeline.sock")  # checked as a private socket on connect
    monkeypatch.setenv("AIRFLOW__TORCHDIST__VIEW_LIFELINE_HOSTS", " 10.0.0.7 , worker-2 ")
    assert lifeline_address_allowed("10.0.0.7") and lifeline_address_allowed("worker-2")
    # A supervisor records the address it bound: an IP, for a host configured by name.
    monkeypatch.setenv("AIRFLOW__TORCHDIST__LIFELINE_HOST", "localhost")
    assert lifeline_address_allowed("127.0.0.1")
    assert not lifeline_address_allowed("127.0.0.2")


def test_a_refusal_names_the_host_and_the_setting_to_add_it_to():
    with pytest.raises(LifelineHostRefused) as refused:
        check_lifeline_address("10.9.9.9", 4444)
    message = str(refused.value)
    assert "10.9.9.9:4444" in message and "127.0.0.1" in message
    assert "[torchdist] view_lifeline_hosts" in message and "torchdist_run" in message


def test_the_task_and_a_retry_do_not_connect_to_a_host_outside_the_list(elsewhere):
    record = record_at(elsewhere)
    with pytest.raises(LifelineHostRefused, match="127.0.0.2"):
        connect_owner(record)  # the task following its run, a retry reattaching
    with pytest.raises(LifelineHostRefused, match="127.0.0.2"):
        run_state(record)  # a retry asking what became of the run
    assert nobody_connected(elsewhere)


def test_the_trigger_does_not_connect_to_a_host_outside_the_list(elsewhere):
    trigger = TorchDistributorTrigger(record_at(elsewhere).to_dict())

    async def first_event() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    event = asyncio.run(asyncio.wait_for(first_event(), 10))
    assert event["state"] == "error" and "not a lifeline host of this deployment" in event["message"]
    assert nobody_connected(elsewhere)
    with pytest.raises(LifelineHostRefused):
        asyncio.run(trigger.on_kill())  # stopping it does not connect there either
    assert nobody_connected(elsewhere)
