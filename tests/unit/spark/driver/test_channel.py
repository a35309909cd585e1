"""The run channel's server: hello and identity, line forwarding, who may send what, rank 0's output.

How reports turn into failures is the ledger's job (``test_ledger.py``); the messages themselves are
``test_protocol.py``'s; the owner stream is ``test_channel_owner.py``'s.
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import time
from dataclasses import dataclass

import pytest

from airflow_provider_torchdist.spark.driver.channel import ChannelClient, ChannelRefused, RunChannel
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused, peer_matches
from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import Metric, NodeLeft, NodeStarted
from tests.unit.conftest import fast_shutdown, wait_until

TOKEN = "the-run-secret"
HOST = "localhost"  # what the fake scheduler says every task runs on: this machine
#: The fake scheduler: (partition, task attempt id) of the running barrier tasks, and their host.
SCHEDULED = {(0, 100): HOST, (1, 101): HOST, (2, 102): HOST}
NPROC = 2  # ranks per node: node n runs ranks 2n and 2n+1


def fake_scheduler(node: int, task_attempt: int, peer_ip: str) -> str:
    host = SCHEDULED.get((node, task_attempt))
    if host is None:
        raise HelloRefused(f"no task attempt {task_attempt} of partition {node}")
    if not peer_matches(peer_ip, host):
        raise HelloRefused(f"node {node} runs on {host}, not {peer_ip}")
    return host


@dataclass
class Channel:
    channel: RunChannel
    out: io.StringIO
    failure_calls: list[int]

    @property
    def text(self) -> str:
        return self.out.getvalue()

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def key(self, node: int) -> bytes:
        """Node ``node``'s key, as its agent would get it (without an agent connection in the log)."""
        found = self.channel.registry._nodes.get(node)
        return found.key if found else self.channel.registry.add_local(node, HOST).key

    def client(self, rank: int | None, token: str = TOKEN, generation: int = 0) -> ChannelClient:
        if rank is None:
            return ChannelClient.as_node(self.channel.address, token, node=1, task_attempt=101, host=HOST)
        return ChannelClient.as_rank(
            self.channel.address,
            token,
            node=rank // NPROC,
            rank=rank,
            generation=generation,
            host=HOST,
            node_key=self.key(rank // NPROC),
        )


def rank0_of(channel: RunChannel) -> ChannelClient:
    """Rank 0 of a channel's local node 0, connected and verified."""
    key = channel.registry.add_local(0, HOST).key
    return ChannelClient.as_rank(
        channel.address, TOKEN, node=0, rank=0, generation=0, host=HOST, node_key=key
    )


def make_channel(tmp_path, out, calls=None, **kwargs) -> RunChannel:
    return fast_shutdown(
        RunChannel(
            TOKEN,
            "127.0.0.1",
            tmp_path,
            on_failure=(lambda: calls.append(1)) if calls is not None else None,
            out=out,
            ranks_of_node=lambda n: range(n * NPROC, (n + 1) * NPROC),
            verify_node=fake_scheduler,
            **kwargs,
        )
    )


@pytest.fixture
def ch(tmp_path):
    out = io.StringIO()
    calls: list[int] = []
    with make_channel(tmp_path, out, calls) as channel:
        yield Channel(channel, out, calls)


def test_lines_are_printed_with_the_rank_prefix(ch):
    assert ch.channel.address[0] == "127.0.0.1"
    client = ch.client(1)
    assert client.line("out", "hello")
    assert client.line("err", "to stderr")
    client.close()  # returns once the channel has read everything
    assert ch.lines == ["[rank 1 @ localhost] hello", "[rank 1 @ localhost] to stderr"]
    assert client.broken is None


def test_wrong_token_is_rejected_and_nothing_is_read(ch):
    with pytest.raises(ChannelRefused):
        ch.client(1, token="not-the-token")
    assert ch.text == ""  # no line, and no "closed without a goodbye" notice either
    assert ch.channel.rejected == 1


def test_garbage_hello_is_rejected(ch):
    with socket.create_connection(ch.channel.address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(100) == b""  # the channel hangs up without answering
    assert ch.channel.rejected == 1
    assert ch.text == ""


def test_token_prefix_is_not_enough(ch):
    with pytest.raises(ChannelRefused):
        ch.client(1, token=TOKEN[:-1])
    assert ch.text == ""


def test_a_one_megabyte_line_passes_whole(ch):
    long = "x" * (1 << 20) + "END"
    client = ch.client(1)
    client.line("out", long)
    client.line("out", "next")
    client.close()
    assert ch.lines == [f"[rank 1 @ localhost] {long}", "[rank 1 @ localhost] next"]


def _output(client: ChannelClient, data: bytes) -> bool:
    import hashlib

    return client.output(data, format="cloudpickle", type="bytes", sha256=hashlib.sha256(data).hexdigest())


def test_rank0_output_lands_atomically_with_exact_bytes(ch, tmp_path):
    data = os.urandom(3 * (1 << 20) + 7)  # crosses the channel's read chunks
    client = ch.client(0)
    assert _output(client, data)
    client.close()
    final = tmp_path / OUTPUT_FILE
    assert final.read_bytes() == data
    assert stat.S_IMODE(final.stat().st_mode) == 0o600
    # No partial file left; the driver's manifest beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUT_FILE, OUTPUT_FILE + ".manifest.json"]
    assert "broke" not in ch.text


def test_a_later_generation_replaces_the_output(ch, tmp_path):
    for generation, data in enumerate((b"first attempt", b"after a restart")):
        client = ch.client(0, generation=generation)
        _output(client, data)
        client.close()
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"after a restart"


def test_a_second_output_in_one_generation_is_refused(ch, tmp_path):
    first = ch.client(0)
    assert _output(first, b"the value")
    first.close()
    again = ch.client(0)  # same generation: a forged or replayed second delivery
    _output(again, b"forged value")
    again.close()
    wait_until(lambda: "second output" in ch.text, what="the refusal")
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"the value"


def test_truncated_output_never_replaces_the_file(ch, tmp_path):
    first = ch.client(0)
    _output(first, b"complete value")
    first.close()
    late = ch.client(0, generation=1)
    late._send_raw(json.dumps({"k": "output", "n": 1000}).encode() + b"\n" + b"only ten b")
    late._sock.shutdown(socket.SHUT_WR)
    late._sock.settimeout(5)
    late._sock.recv(1)
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"complete value"
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "ended after 10 of 1000 bytes" in ch.text


def test_output_from_another_rank_is_refused(ch, tmp_path):
    client = ch.client(1)
    _output(client, b"not rank 0")
    client.close()
    assert not (tmp_path / OUTPUT_FILE).exists()
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "only global rank 0 may" in ch.text


def test_rank0_claim_with_node1s_key_is_refused(ch, tmp_path):
    """An executor of node 1 holds the run token and node 1's key: it cannot pass for rank 0."""
    ch.key(0)  # node 0 is registered, with a key node 1 never sees
    node1_key = ch.key(1)
    with pytest.raises(ChannelRefused, match="did not prove"):
        ChannelClient.as_rank(
            ch.channel.address, TOKEN, node=0, rank=0, generation=0, host=HOST, node_key=node1_key
        )
    # Nor by claiming rank 0 as one of node 1's ranks.
    with pytest.raises(ChannelRefused, match="does not belong to node 1"):
        ChannelClient.as_rank(
            ch.channel.address, TOKEN, node=1, rank=0, generation=0, host=HOST, node_key=node1_key
        )
    assert not (tmp_path / OUTPUT_FILE).exists()
    wait_until(lambda: ch.channel.rejected == 2, what="both refusals counted")


def test_node_registration_is_bound_to_the_scheduler(ch):
    agent = ChannelClient.as_node(ch.channel.address, TOKEN, node=0, task_attempt=100, host="claimed")
    assert agent.node_key and len(agent.node_key) == 32
    assert ch.channel.registry.host_of(0) == HOST  # the scheduler's host, not the claim
    agent.close()
    with pytest.raises(ChannelRefused, match="already registered"):  # a replayed registration
        ChannelClient.as_node(ch.channel.address, TOKEN, node=0, task_attempt=100, host=HOST)
    with pytest.raises(ChannelRefused, match="no task attempt 101 of partition 0"):  # node 1's task
        ChannelClient.as_node(ch.channel.address, TOKEN, node=0, task_attempt=101, host=HOST)


def test_a_rank_from_another_host_is_refused(tmp_path):
    """Node 0 runs on a host that is not this machine: a connection from here cannot be its rank."""
    channel = make_channel(tmp_path, io.StringIO())
    with channel:
        node = channel.registry.add_local(0, "192.0.2.77")  # TEST-NET-1: never a local address
        with pytest.raises(ChannelRefused, match="connected from 127.0.0.1, not 192.0.2.77"):
            ChannelClient.as_rank(
                channel.address, TOKEN, node=0, rank=0, generation=0, host=HOST, node_key=node.key
            )


def test_a_trickling_hello_is_dropped_at_the_deadline(tmp_path):
    channel = make_channel(tmp_path, io.StringIO(), hello_timeout=1.5)
    with channel, socket.create_connection(channel.address) as sock:
        start = time.monotonic()
        hello = json.dumps({"token": TOKEN, "role": "rank"}).encode()
        closed_after = None
        for byte in hello:  # one byte every 0.4 s: each read would meet a per-read timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - start
                break
            sock.settimeout(0.4)
            try:
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                pass
        assert closed_after is not None, "the channel kept reading a hello that never ended"
        assert 1.4 < closed_after < 3.0
        assert channel.rejected == 1 and "took too long" in channel.refusals[0]


def test_unauthenticated_connections_are_capped(tmp_path):
    from airflow_provider_torchdist.spark.wire.channel_auth import MAX_UNAUTHENTICATED

    channel = make_channel(tmp_path, io.StringIO())
    with channel:
        idle = [socket.create_connection(channel.address) for _ in range(MAX_UNAUTHENTICATED)]
        wait_until(lambda: channel._gate._slots._value == 0, what="the hello slots to fill")
        with socket.create_connection(channel.address) as extra:
            extra.settimeout(5)
            assert extra.recv(1) == b""  # dropped at once, not held for the deadline
        for sock in idle:
            sock.close()
        wait_until(lambda: channel._gate._slots._value == MAX_UNAUTHENTICATED, what="the slots to free")
        client = rank0_of(channel)
        client.close()


def test_errors_and_failures_reach_the_ledger_with_the_verified_host(ch):
    rank1 = ch.client(1)
    rank1.error({"exc_type": "ValueError", "message": "boom", "traceback": "Traceback: ...boom"})
    rank1.close()
    agent = ch.client(None)  # node 1's agent: the scheduler runs it on localhost
    agent.failures([RankFailure(rank=1, host="claimed-elsewhere", local_rank=0, exitcode=1)])
    agent.close()

    ledger = ch.channel.ledger
    assert ledger.rank_errors[1] == RankFailure(
        rank=1, host="localhost", exc_type="ValueError", message="boom", traceback="Traceback: ...boom"
    )
    assert ledger.agent_failures == [RankFailure(rank=1, host="localhost", local_rank=0, exitcode=1)]
    assert ch.channel.failures[0].exc_type == "ValueError"  # merged by the ledger
    assert ch.failure_calls == [1]  # the driver was told at once, to cancel the stage
    assert ch.text == ""  # errors are kept, not printed


def test_a_message_from_the_wrong_role_ends_the_connection(ch):
    rank1 = ch.client(1)
    rank1.failures([RankFailure(rank=3, exitcode=1)])  # only an agent may give a verdict
    rank1.close()
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "'failures' is not allowed on this connection" in ch.text
    assert ch.channel.ledger.agent_failures == [] and ch.failure_calls == []
    agent = ch.client(None)
    agent.error({"exc_type": "ValueError"})  # only a rank reports its own exception
    agent.close()
    wait_until(lambda: "'error' is not allowed" in ch.text, what="the refusal")
    assert ch.channel.ledger.rank_errors == {}


def test_a_malformed_message_is_reported_not_raised(ch):
    client = ch.client(1)
    client._send_raw(b'{"k": "line", "s": "out", "l": 5}\n')
    client.close()
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "broke: ProtocolError(\"'line' message: field 'l' must be str, got int\")" in ch.text


def test_metrics_and_nodes(ch):
    client = ch.client(0)
    record = {"rank": 0, "step": 3, "time": 1.0, "loss": 0.5}
    client.send(Metric(record))
    agent = ch.client(None)  # node 1's agent
    agent.send(NodeStarted())
    agent.close()
    client.close()
    assert ch.channel.metrics == [record]
    assert ch.channel.started_nodes == {1}
    assert ch.lines == ["[metrics] rank 0 step 3: loss=0.5"]


def test_close_without_bye_prints_a_notice(ch):
    client = ch.client(4)
    client.line("out", "last words")
    client._sock.close()  # the process died: no goodbye
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert ch.lines[0] == "[rank 4 @ localhost] last words"
    assert ch.lines[1].startswith("[torchdist] channel from [rank 4 @ localhost] closed without a goodbye")


def test_an_agent_gone_without_a_goodbye_or_that_left_is_told_and_a_rank_or_clean_close_is_not(
    tmp_path,
):
    """Over Spark Connect, an elastic run's loss: the node's agent (its process) died."""
    gone: list[tuple[int, int, str]] = []
    with make_channel(
        tmp_path, io.StringIO(), on_node_gone=lambda n: gone.append((n.node, n.attempt, n.host))
    ) as channel:
        agent = ChannelClient.as_node(channel.address, TOKEN, node=1, task_attempt=101, host=HOST)
        agent._sock.close()  # its executor was killed
        wait_until(lambda: gone, what="the loss")
        rank = ChannelClient.as_rank(
            channel.address, TOKEN, node=1, rank=2, generation=0, host=HOST, node_key=agent.node_key
        )
        rank._sock.close()  # a rank is the agent's to restart, not a lost node
        ChannelClient.as_node(channel.address, TOKEN, node=2, task_attempt=102, host=HOST).close()
        time.sleep(0.3)
        assert gone == [(1, 0, HOST)]
        # Spark stopped node 0's task (SIGHUP from its Python daemon, its executor gone): the agent
        # says it leaves, then closes cleanly.
        leaving = ChannelClient.as_node(channel.address, TOKEN, node=0, task_attempt=100, host=HOST)
        leaving.send(NodeLeft())
        leaving.close()
        wait_until(lambda: len(gone) == 2, what="the node that left")
    assert gone == [(1, 0, HOST), (0, 0, HOST)]


def test_clean_close_prints_no_notice(ch):
    client = ch.client(0)
    client.close()
    assert ch.text == ""


def test_say_prints_the_drivers_own_lines(ch):
    ch.channel.say("local mode: 2 process(es) on the driver")
    assert ch.lines == ["[torchdist] local mode: 2 process(es) on the driver"]


def test_client_to_a_closed_channel_goes_broken_instead_of_raising(tmp_path):
    channel = make_channel(tmp_path, io.StringIO())
    with channel:
        client = rank0_of(channel)
    client._sock.close()
    assert client.line("out", "x") is False
    assert client.broken
    assert client.output(b"data") is False
    client.close()  # must not raise


# -- stop requests ------------------------------------------------------------------------------


def test_a_stop_request_in_the_staging_directory_reaches_every_rank_connected_now_or_later(ch, tmp_path):
    """The stopper writes ``stop-request.json``; the channel sends each rank a StopRequest over its own
    connection, a rank that connects afterwards (a restarted worker group) included; agents get none."""
    from airflow_provider_torchdist.spark.wire.protocol import StopRequest
    from airflow_provider_torchdist.spark.wire.stop_request import write_stop_request

    heard: dict[str, list[object]] = {"rank 0": [], "rank 1": [], "rank 2": []}
    early = [ch.client(0), ch.client(1)]
    for name, client in zip(("rank 0", "rank 1"), early, strict=True):
        client.listen(heard[name].append)
    agent = ch.client(None)
    agent_heard: list[object] = []
    agent.listen(agent_heard.append)

    write_stop_request(tmp_path, "timeout", 30.0)
    wait_until(lambda: heard["rank 0"] and heard["rank 1"], what="both ranks to hear the stop")
    late = ch.client(2)
    late.listen(heard["rank 2"].append)
    wait_until(lambda: heard["rank 2"], what="the late rank to hear it")

    assert all(got == [StopRequest("timeout", 30.0)] for got in heard.values()), heard
    assert ch.channel.stops.request == StopRequest("timeout", 30.0)
    assert "[torchdist] the stop request (timeout) goes to 2 rank(s)" in ch.lines
    assert ch.channel.stops.stop("again", 1.0) is False  # asked once; the first request stands
    time.sleep(0.2)
    assert agent_heard == [] and all(len(got) == 1 for got in heard.values())
    for client in (*early, late, agent):
        client.close()


@pytest.mark.parametrize(
    "text",
    [
        '{"k": "stop", "reason": "timeout"}',
        '{"k": "stop", "reason": 5, "grace": 1}',
        '{"k": "stop", "reason": "x", "grace": -1}',
        '{"k": "stop", "reason": "x", "grace": NaN}',
        '{"k": "stop", "reason": "x", "grace": true}',
        '{"k": "bye"}',  # a message, but not a stop
        '{"reason": "x", "grace": 1}',  # no kind
        "[]",
        "{",
    ],
)
def test_a_stop_request_file_that_is_not_one_is_ignored(tmp_path, text):
    """Whatever the file holds, a malformed request stops nothing here (the hard stop still comes)."""
    from airflow_provider_torchdist.spark.wire.stop_request import STOP_REQUEST_FILE, read_stop_request

    (tmp_path / STOP_REQUEST_FILE).write_text(text)
    assert read_stop_request(tmp_path) is None


def test_a_stop_request_is_written_privately_and_its_reason_cut_to_size(tmp_path):
    from airflow_provider_torchdist.spark.wire.protocol import STOP_REASON_CHARS, StopRequest
    from airflow_provider_torchdist.spark.wire.stop_request import read_stop_request, write_stop_request

    path = write_stop_request(tmp_path, "x" * 1000, 12)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_stop_request(tmp_path) == StopRequest("x" * STOP_REASON_CHARS, 12.0)


def test_when_no_rank_watches_for_stops_the_stopper_is_told_not_to_wait(ch, tmp_path):
    """Every connected rank answered that its code never asked stop_requested(): ``stop-declined``
    tells the supervisor to end the run now. One watching rank keeps the grace period."""
    from airflow_provider_torchdist.spark.wire.protocol import StopAnswer
    from airflow_provider_torchdist.spark.wire.stop_request import stop_declined

    ranks = [ch.client(0), ch.client(1)]
    wait_until(lambda: len(ch.channel.stops._ranks) == 2, what="both ranks")
    ch.channel.stops.stop("timeout", 30.0, from_stopper=True)
    ranks[0].send(StopAnswer(False))
    wait_until(lambda: 0 in ch.channel.stops.answers, what="rank 0's answer")
    assert not stop_declined(tmp_path)  # rank 1 has not answered
    ranks[1].send(StopAnswer(False))
    wait_until(lambda: stop_declined(tmp_path), what="the run to be declared unwatched")
    assert any("no rank's code watches for stops" in line for line in ch.lines)
    for client in ranks:
        client.close()


def test_one_watching_rank_keeps_the_grace_period(ch, tmp_path):
    from airflow_provider_torchdist.spark.wire.protocol import StopAnswer
    from airflow_provider_torchdist.spark.wire.stop_request import stop_declined

    ranks = [ch.client(0), ch.client(1)]
    wait_until(lambda: len(ch.channel.stops._ranks) == 2, what="both ranks")
    ch.channel.stops.stop("timeout", 30.0, from_stopper=True)
    ranks[0].send(StopAnswer(True))
    ranks[1].send(StopAnswer(False))
    wait_until(lambda: len(ch.channel.stops.answers) == 2, what="both answers")
    assert ch.channel.stops.answers == {0: True, 1: False}
    assert not stop_declined(tmp_path)
    for client in ranks:
        client.close()


def test_the_drivers_own_stop_tells_no_stopper_and_once_withdrawn_reaches_no_new_rank(ch, tmp_path):
    """A decommissioned node's stop comes from the driver itself: no ``stop-declined`` file (the
    supervisor did not ask), but ``declined`` says that no rank watches. Withdrawn (an elastic
    group meeting again without the node), the ranks of the new group are not stopped."""
    from airflow_provider_torchdist.spark.wire.protocol import StopAnswer
    from airflow_provider_torchdist.spark.wire.stop_request import DECOMMISSIONED, stop_declined

    ranks = [ch.client(0), ch.client(1)]
    wait_until(lambda: len(ch.channel.stops._ranks) == 2, what="both ranks")
    assert ch.channel.stops.stop(DECOMMISSIONED, 5.0)
    for client in ranks:
        client.send(StopAnswer(False))
    assert ch.channel.stops.declined.wait(5)
    assert not stop_declined(tmp_path)

    ch.channel.stops.withdraw()
    assert ch.channel.stops.request is None and not ch.channel.stops.declined.is_set()
    heard: list[object] = []
    new_rank = ch.client(2)
    new_rank.listen(heard.append)
    wait_until(lambda: 2 in ch.channel.stops._ranks.values(), what="the new group's rank")
    time.sleep(0.2)
    assert heard == []
    assert ch.channel.stops.stop("timeout", 30.0, from_stopper=True)  # a later stop is a first one
    wait_until(lambda: heard, what="the new rank to hear the later stop")
    for client in (*ranks, new_rank):
        client.close()


def test_an_agent_may_not_answer_a_stop(ch):
    from airflow_provider_torchdist.spark.wire.protocol import StopAnswer

    agent = ch.client(None)
    agent.send(NodeStarted())
    ch.channel.stops.stop("timeout", 30.0)
    agent.send(StopAnswer(False))
    wait_until(
        lambda: any("is not allowed on this connection" in line for line in ch.lines), what="the refusal"
    )
    assert ch.channel.stops.answers == {}
    agent.close()


def test_a_rank_may_not_forge_the_drivers_step_time_records(ch):
    """Each rank's step time is the driver's record (``"summary": "step_time"``): a rank's
    message carrying one ends its connection and reaches no metrics."""
    from airflow_provider_torchdist.spark.wire.protocol import Metric

    rank1 = ch.client(1)
    rank1.send(Metric({"rank": 0, "step": None, "time": 1.0, "summary": "step_time", "compute_share": 0.1}))
    rank1.close()
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "a rank may not send a 'summary' record" in ch.text
    assert ch.channel.metrics == []
