"""The run channel: token auth, line forwarding, errors and failures, rank 0's output."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
from dataclasses import dataclass

import pytest

from airflow_provider_torchdist.spark.channel import ChannelClient, RunChannel, rank_prefix
from airflow_provider_torchdist.spark.jobspec import OUTPUT_FILE
from airflow_provider_torchdist.spark.outcome import RankFailure
from tests.unit.conftest import fast_shutdown, wait_until

TOKEN = "the-run-secret"


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

    def client(self, rank: int | None, host: str | None = "hostX", token: str = TOKEN) -> ChannelClient:
        return ChannelClient(self.channel.address, token, rank, host)


@pytest.fixture
def ch(tmp_path):
    out = io.StringIO()
    calls: list[int] = []
    channel = RunChannel(TOKEN, "127.0.0.1", tmp_path, on_failure=lambda: calls.append(1), out=out)
    fast_shutdown(channel)
    with channel:
        yield Channel(channel, out, calls)


def test_rank_prefix():
    assert rank_prefix(1, "hostX") == "[rank 1 @ hostX]"
    assert rank_prefix(None, "hostX") == "[agent @ hostX]"
    assert rank_prefix(0, None) == "[rank 0]"


def test_lines_are_printed_with_the_rank_prefix(ch):
    assert ch.channel.address[0] == "127.0.0.1"
    client = ch.client(1)
    assert client.line("out", "hello")
    assert client.line("err", "to stderr")
    client.close()  # returns once the channel has read everything
    assert ch.lines == ["[rank 1 @ hostX] hello", "[rank 1 @ hostX] to stderr"]
    assert client.broken is None


def test_wrong_token_is_rejected_and_nothing_is_read(ch):
    client = ch.client(1, token="not-the-token")
    client.line("out", "injected")
    wait_until(lambda: ch.channel.rejected == 1, what="the rejection")
    client.close()
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
    client = ch.client(1, token=TOKEN[:-1])
    client.line("out", "x")
    wait_until(lambda: ch.channel.rejected == 1, what="the rejection")
    client.close()
    assert ch.text == ""


def test_a_one_megabyte_line_passes_whole(ch):
    long = "x" * (1 << 20) + "END"
    client = ch.client(1)
    client.line("out", long)
    client.line("out", "next")
    client.close()
    assert ch.lines == [f"[rank 1 @ hostX] {long}", "[rank 1 @ hostX] next"]


def test_rank0_output_lands_atomically_with_exact_bytes(ch, tmp_path):
    data = os.urandom(3 * (1 << 20) + 7)  # crosses the channel's read chunks
    client = ch.client(0)
    assert client.output(data)
    client.close()
    final = tmp_path / OUTPUT_FILE
    assert final.read_bytes() == data
    assert stat.S_IMODE(final.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUT_FILE]  # no partial file left
    assert "broke" not in ch.text


def test_the_latest_complete_output_wins(ch, tmp_path):
    for data in (b"first attempt", b"after a restart"):
        client = ch.client(0)
        client.output(data)
        client.close()
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"after a restart"


def test_truncated_output_never_replaces_the_file(ch, tmp_path):
    first = ch.client(0)
    first.output(b"complete value")
    first.close()
    with socket.create_connection(ch.channel.address) as sock:
        sock.sendall(json.dumps({"token": TOKEN, "rank": 0, "host": "hostX"}).encode() + b"\n")
        sock.sendall(json.dumps({"k": "output", "n": 1000}).encode() + b"\n" + b"only ten b")
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        sock.recv(1)
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"complete value"
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "ended after 10 of 1000 bytes" in ch.text


def test_output_from_another_rank_is_refused(ch, tmp_path):
    client = ch.client(1)
    client.output(b"not rank 0")
    client.close()
    assert not (tmp_path / OUTPUT_FILE).exists()
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert "only global rank 0 may" in ch.text


def test_errors_and_agent_failures_are_merged_per_rank(ch):
    rank1 = ch.client(1)
    rank1.error({"exc_type": "ValueError", "message": "boom", "traceback": "Traceback: ...boom"})
    rank1.close()
    rank2 = ch.client(2, host="hostY")
    rank2.error({"exc_type": "KeyError", "message": "'k'", "traceback": "tb2"})
    rank2.close()
    agent = ch.client(None)
    agent.failures(
        [
            RankFailure(rank=3, host="hostX", local_rank=1, exitcode=-9, signal="SIGKILL"),
            RankFailure(rank=1, host="hostX", local_rank=0, exitcode=1),
        ]
    )
    agent.close()

    assert ch.channel.failures == [
        RankFailure(
            rank=1,
            host="hostX",
            local_rank=0,
            exitcode=1,
            exc_type="ValueError",
            message="boom",
            traceback="Traceback: ...boom",
        ),
        RankFailure(rank=3, host="hostX", local_rank=1, exitcode=-9, signal="SIGKILL"),
    ]
    # Rank 2 raised, but its agent did not report it failed (a restart may have fixed it): not a failure.
    assert 2 in ch.channel.rank_errors
    assert ch.failure_calls == [1]  # the driver was told at once, to cancel the stage
    assert ch.text == ""  # errors are kept, not printed


def test_agent_failure_without_a_rank_is_kept(ch):
    agent = ch.client(None)
    agent.failures([RankFailure(rank=None, host="hostX", exc_type="TimeoutError", message="rendezvous")])
    agent.close()
    assert ch.channel.failures == [
        RankFailure(rank=None, host="hostX", exc_type="TimeoutError", message="rendezvous")
    ]


def test_metrics_and_nodes(ch):
    client = ch.client(0)
    record = {"rank": 0, "step": 3, "time": 1.0, "loss": 0.5}
    client.send({"k": "metric", "m": record})
    agent = ch.client(None)
    agent.send({"k": "node", "node": 1})
    agent.close()
    client.close()
    assert ch.channel.metrics == [record]
    assert ch.channel.started_nodes == {1}
    assert ch.lines == ["[metrics] rank 0 step 3: loss=0.5"]


def test_close_without_bye_prints_a_notice(ch):
    client = ch.client(4, host="hostZ")
    client.line("out", "last words")
    client._sock.close()  # the process died: no goodbye
    wait_until(lambda: "closed without a goodbye" in ch.text, what="the notice")
    assert ch.lines[0] == "[rank 4 @ hostZ] last words"
    assert ch.lines[1].startswith("[torchdist] channel from [rank 4 @ hostZ] closed without a goodbye")


def test_clean_close_prints_no_notice(ch):
    client = ch.client(0)
    client.close()
    assert ch.text == ""


def test_say_prints_the_drivers_own_lines(ch):
    ch.channel.say("local mode: 2 process(es) on the driver")
    assert ch.lines == ["[torchdist] local mode: 2 process(es) on the driver"]


def test_client_to_a_closed_channel_goes_broken_instead_of_raising(tmp_path):
    channel = fast_shutdown(RunChannel(TOKEN, "127.0.0.1", tmp_path, out=io.StringIO()))
    with channel:
        client = ChannelClient(channel.address, TOKEN, 0, "h")
    client._sock.close()
    assert client.line("out", "x") is False
    assert client.broken
    assert client.output(b"data") is False
    client.close()  # must not raise
