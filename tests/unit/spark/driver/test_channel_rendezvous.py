"""Task 0's rendezvous endpoint through the run channel: the other barrier tasks get it from the
driver as soon as task 0 reports it (no allGather, no 1 s poll)."""

from __future__ import annotations

import io
import itertools
import threading
import time

import pytest

from airflow_provider_torchdist.spark.driver.channel import ChannelClient, RunChannel
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused, peer_matches
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import NodeStarted
from tests.unit.conftest import fast_shutdown

TOKEN = "the-run-secret"
HOST = "localhost"  # where the fake scheduler says every barrier task runs: this machine
#: Spark task attempt ids are unique across a run's stage attempts; each agent here gets a fresh one.
_task_attempts = itertools.count(100)


def fake_scheduler(node: int, task_attempt: int, peer_ip: str) -> str:
    """Spark's scheduler as the driver asks it: every task attempt of every partition runs on HOST."""
    if not peer_matches(peer_ip, HOST):
        raise HelloRefused(f"node {node} runs on {HOST}, not {peer_ip}")
    return HOST


def _channel(tmp_path) -> RunChannel:
    return RunChannel(
        TOKEN,
        "127.0.0.1",
        tmp_path,
        out=io.StringIO(),
        ranks_of_node=lambda n: range(n, n + 1),
        verify_node=fake_scheduler,
    )


@pytest.fixture
def channel(tmp_path):
    ch = fast_shutdown(_channel(tmp_path))
    with ch:
        yield ch


def _client(ch: RunChannel, node: int = 1) -> ChannelClient:
    """A barrier task's line to the driver, after its ``node`` message (as barrier_task sends it)."""
    client = ChannelClient.as_node(ch.address, TOKEN, node=node, task_attempt=next(_task_attempts), host=HOST)
    client.send(NodeStarted())
    return client


def test_other_tasks_get_task0s_endpoint_the_moment_it_arrives(channel):
    waiter, task0 = _client(channel), _client(channel, node=0)
    got: list[tuple[str, int]] = []
    thread = threading.Thread(target=lambda: got.append(waiter.wait_for_master(30)))
    thread.start()
    time.sleep(0.2)
    assert not got  # still waiting for task 0
    sent = time.monotonic()
    assert task0.announce_master("10.0.0.7", 29500)
    thread.join(5)
    assert got == [("10.0.0.7", 29500)]
    assert time.monotonic() - sent < 0.5
    # A task that asks later gets it at once.
    assert _client(channel, node=2).wait_for_master(30) == ("10.0.0.7", 29500)
    for client in (waiter, task0):
        client.close()


def test_a_retried_stage_never_gets_the_endpoint_of_the_attempt_before(channel):
    first = _client(channel, node=0)
    first.announce_master("h0", 1)
    assert _client(channel, node=1).wait_for_master(5) == ("h0", 1)
    # The stage runs again: node 1 starts before node 0 and must wait for the new endpoint.
    retried_node1 = _client(channel, node=1)
    got: list[tuple[str, int]] = []
    thread = threading.Thread(target=lambda: got.append(retried_node1.wait_for_master(30)))
    thread.start()
    time.sleep(0.2)
    assert not got
    _client(channel, node=0).announce_master("h1", 2)
    thread.join(5)
    assert got == [("h1", 2)]


def _wait_in_thread(waiter) -> tuple[threading.Thread, list[str]]:
    """``wait_for_master`` in a thread; the errors it raised are collected in the list."""
    errors: list[str] = []

    def wait() -> None:
        try:
            waiter.wait_for_master(30)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, errors


def test_waiting_ends_with_an_error_when_a_node_fails_first(channel):
    waiter = _client(channel)
    thread, errors = _wait_in_thread(waiter)
    time.sleep(0.1)
    _client(channel, node=0).failures(
        [RankFailure(rank=None, host="h0", exc_type="RuntimeError", message="no GPU")]
    )
    thread.join(5)
    assert errors and "failed before the rendezvous" in errors[0]
    waiter.close()


def test_waiting_times_out_with_a_message_naming_task0(channel):
    with pytest.raises(RuntimeError, match="task 0 did not report its rendezvous endpoint within 0s"):
        _client(channel).wait_for_master(0.2)


def test_waiters_are_released_when_the_driver_closes(tmp_path):
    ch = fast_shutdown(_channel(tmp_path))
    with ch:
        thread, errors = _wait_in_thread(_client(ch))
        time.sleep(0.1)
    thread.join(5)
    assert errors and ("shutting down" in errors[0] or "closed" in errors[0])


def test_close_does_not_wait_for_a_socketserver_poll(tmp_path):
    ch = _channel(tmp_path)
    ch.__enter__()
    time.sleep(0.05)
    started = time.monotonic()
    ch.close()
    assert time.monotonic() - started < 0.2
