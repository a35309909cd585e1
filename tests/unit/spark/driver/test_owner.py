"""The owner role: the hook follows the run's log, application and metrics over the run channel."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import threading

import pytest

from airflow_provider_torchdist.spark.driver.channel import ChannelClient, ChannelRefused, RunChannel
from airflow_provider_torchdist.spark.driver.owner import (
    REPLAY_LINES,
    OwnerClient,
    read_channel_address,
    read_owner_token,
    write_channel_address,
    write_owner_token,
)
from airflow_provider_torchdist.spark.wire.jobspec import CHANNEL_FILE, OWNER_TOKEN_FILE
from airflow_provider_torchdist.spark.wire.protocol import Application, LogLine, Metric
from tests.unit.conftest import fast_shutdown, wait_until

TOKEN = "the-run-secret"
OWNER = "the-owner-secret"
HOST = "localhost"


def make_channel(tmp_path, out: io.StringIO, **kwargs) -> RunChannel:
    kwargs.setdefault("owner_token", OWNER)
    return fast_shutdown(RunChannel(TOKEN, "127.0.0.1", tmp_path, out=out, ranks_of_node=range, **kwargs))


def rank_of(channel: RunChannel, rank: int = 0) -> ChannelClient:
    """Rank ``rank`` of the channel's local node 0 (``ranks_of_node=range``: node 0 holds none, so
    node ``n`` holds ranks 0..n-1; rank r is one of node r+1's)."""
    node = channel.registry.add_local(rank + 1, HOST)
    return ChannelClient.as_rank(
        channel.address, TOKEN, node=rank + 1, rank=rank, generation=0, host=HOST, node_key=node.key
    )


class Follower:
    """An owner reading ``events()`` in a thread until the stream ends."""

    def __init__(self, channel: RunChannel, token: str = OWNER) -> None:
        self.client = OwnerClient(channel.address, token)
        self.events: list[object] = []
        self.thread = threading.Thread(target=lambda: self.events.extend(self.client.events()), daemon=True)
        self.thread.start()

    @property
    def lines(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, LogLine)]

    def ended(self, timeout: float = 30.0) -> bool:  # a bound, not a wait: it returns when the stream ends
        self.thread.join(timeout)
        return not self.thread.is_alive()


def test_an_owner_gets_the_replay_then_the_live_lines(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        channel.say("local mode: 2 process(es) on the driver")
        rank = rank_of(channel)
        rank.line("out", "before the owner")
        wait_until(lambda: "before the owner" in out.getvalue(), what="the early line")
        follower = Follower(channel)
        rank.line("err", "after \x1b[2J the owner")
        rank.close()
        wait_until(lambda: len(follower.lines) == 3, what="the live line")
    assert follower.ended(), "events() did not end when the channel closed"
    printed = out.getvalue().splitlines()
    assert (
        follower.lines
        == printed
        == [
            "[torchdist] local mode: 2 process(es) on the driver",
            "[rank 0 @ localhost] before the owner",
            "[rank 0 @ localhost] after \\x1b[2J the owner",  # escaped exactly as printed
        ]
    )


def test_the_replay_keeps_the_latest_lines(tmp_path):
    with make_channel(tmp_path, io.StringIO()) as channel:
        for i in range(REPLAY_LINES + 5):
            channel.say(f"line {i}")
        follower = Follower(channel)
    assert follower.ended()
    assert len(follower.lines) == REPLAY_LINES
    assert (
        follower.lines[0] == "[torchdist] line 5"
        and follower.lines[-1] == f"[torchdist] line {REPLAY_LINES + 4}"
    )


def test_the_application_event_comes_first_and_live(tmp_path):
    with make_channel(tmp_path, io.StringIO()) as channel:
        early = Follower(channel)
        channel.say("distributed mode")
        # The follower connects in its thread: once it has the line (live or replayed), it is live.
        wait_until(lambda: len(early.events) == 1, what="the early owner to connect")
        channel.application("app-20240101-0001", "http://driver:4040")
        wait_until(lambda: len(early.events) == 3, what="the live application")
        late = Follower(channel)
    assert early.ended() and late.ended()
    app = Application("app-20240101-0001", "http://driver:4040")
    line = LogLine("[torchdist] application app-20240101-0001 spark-ui http://driver:4040")
    assert early.events == [LogLine("[torchdist] distributed mode"), app, line]
    # A late owner gets the application first, then the lines.
    assert late.events == [app, LogLine("[torchdist] distributed mode"), line]


def test_without_echo_nothing_reaches_stdout(tmp_path):
    """With an owner following the run, the log goes to the owner only: nothing to scrape."""
    out = io.StringIO()
    with make_channel(tmp_path, out, echo_stdout=False) as channel:
        follower = Follower(channel)
        channel.say("local mode")
        # The follower connects in its thread: once it has the line (live or replayed), it is live.
        wait_until(lambda: len(follower.events) == 1, what="the owner to connect")
        channel.application("app-1", None)
        rank = rank_of(channel)
        rank.line("out", "training")
        rank.close()
        wait_until(lambda: len(follower.events) == 4, what="the owner's events")
    assert out.getvalue() == ""
    assert follower.ended()
    assert follower.events[1] == Application("app-1", None)
    assert follower.lines == [
        "[torchdist] local mode",
        "[torchdist] application app-1 spark-ui -",
        "[rank 0 @ localhost] training",
    ]


def test_an_owner_gets_metrics_as_records_and_lines(tmp_path):
    record = {"rank": 0, "step": 3, "time": 1.0, "loss": 0.5}
    with make_channel(tmp_path, io.StringIO()) as channel:
        follower = Follower(channel)
        rank = rank_of(channel)
        rank.send(Metric(record))
        rank.close()
        wait_until(lambda: len(follower.events) == 2, what="the metric")
    assert follower.ended()
    assert follower.events == [Metric(record), LogLine("[metrics] rank 0 step 3: loss=0.5")]


def test_a_late_owner_gets_every_metric_reported_before_it_connected(tmp_path):
    """Issue 29: the supervisor's follower can connect after the ranks' first reports (a loaded
    machine); the Training view's live figures come from what it got, so the replay must hold every
    metric so far, not only the log lines, in the order they happened."""
    records = [{"rank": 0, "step": step, "time": float(step), "loss": 1.0 / (step + 1)} for step in range(4)]
    with make_channel(tmp_path, io.StringIO()) as channel:
        rank = rank_of(channel)
        for record in records[:3]:
            rank.send(Metric(record))
        wait_until(lambda: len(channel.metrics) == 3, what="the early reports")
        late = Follower(channel)
        wait_until(lambda: len(late.events) == 6, what="the replay")
        rank.send(Metric(records[3]))
        rank.close()
        wait_until(lambda: len(late.events) == 8, what="the live report")
    assert late.ended()
    assert [e.record for e in late.events if isinstance(e, Metric)] == records
    # In order: each metric record, then its log line.
    assert [type(e).__name__ for e in late.events] == ["Metric", "LogLine"] * 4


def test_several_owners_get_the_same_stream(tmp_path):
    with make_channel(tmp_path, io.StringIO()) as channel:
        followers = [Follower(channel) for _ in range(3)]
        for i in range(50):
            channel.say(f"line {i}")
        wait_until(lambda: all(len(f.events) == 50 for f in followers), what="every owner's lines")
        followers[0].client.close()  # one owner leaves: the others go on
        assert followers[0].ended()
        channel.say("after one left")
        wait_until(lambda: all(len(f.events) == 51 for f in followers[1:]), what="the next line")
    for follower in followers[1:]:
        assert follower.ended()
        assert follower.lines == [f"[torchdist] line {i}" for i in range(50)] + ["[torchdist] after one left"]


@pytest.mark.parametrize("token", ["wrong", OWNER[:-1], TOKEN, ""])
def test_a_wrong_owner_token_is_refused_without_an_answer(tmp_path, token):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        channel.say("secret training log")
        with pytest.raises(ChannelRefused):
            OwnerClient(channel.address, token)
        wait_until(lambda: channel.rejected == 1, what="the refusal")
        assert channel.refusals == ["wrong owner token"]


def test_without_an_owner_token_no_owner_is_accepted(tmp_path):
    with make_channel(tmp_path, io.StringIO(), owner_token=None) as channel:
        with pytest.raises(ChannelRefused):
            OwnerClient(channel.address, "")
        with pytest.raises(ChannelRefused):
            OwnerClient(channel.address, "None")


def test_the_owner_token_makes_no_rank(tmp_path):
    """The owner token is not the run token: it opens no rank or agent connection."""
    with make_channel(tmp_path, io.StringIO()) as channel:
        node = channel.registry.add_local(1, HOST)
        with pytest.raises(ChannelRefused):
            ChannelClient.as_rank(
                channel.address, OWNER, node=1, rank=0, generation=0, host=HOST, node_key=node.key
            )


def test_what_an_owner_sends_is_never_read(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        follower = Follower(channel)
        follower.client._sock.sendall(b'{"k": "line", "s": "out", "l": "forged"}\n')
        channel.say("real")
        wait_until(lambda: follower.lines == ["[torchdist] real"], what="the real line")
    assert follower.ended()
    assert "forged" not in out.getvalue()


def test_close_ends_events_in_another_thread(tmp_path):
    with make_channel(tmp_path, io.StringIO()) as channel:
        follower = Follower(channel)
        follower.client.close()
        assert follower.ended()


def test_the_token_and_address_files(tmp_path):
    assert read_owner_token(tmp_path) is None and read_channel_address(tmp_path) is None
    token = write_owner_token(tmp_path)
    assert len(token) >= 43 and read_owner_token(tmp_path) == token
    write_channel_address(tmp_path, ("10.0.0.1", 4242))
    assert read_channel_address(tmp_path) == ("10.0.0.1", 4242)
    for name in (OWNER_TOKEN_FILE, CHANNEL_FILE):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert json.loads((tmp_path / CHANNEL_FILE).read_text()) == {"host": "10.0.0.1", "port": 4242}
    assert sorted(os.listdir(tmp_path)) == [CHANNEL_FILE, OWNER_TOKEN_FILE]  # no temporary left


def test_the_driver_publishes_its_channel_for_the_owner(tmp_path, monkeypatch):
    """Local mode end to end, torch not run: the hook's token file in, ``channel.json`` out."""
    from airflow_provider_torchdist.spark import app as driver
    from airflow_provider_torchdist.spark.node import launcher
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

    token = write_owner_token(tmp_path)
    seen: list[object] = []

    def fake_launch_node(spec, **kwargs):  # the ranks' place: meanwhile, the hook connects
        address = read_channel_address(tmp_path)
        assert address == kwargs["channel_address"]
        with OwnerClient(address, token) as owner:
            seen.append(next(owner.events()))
        return []

    monkeypatch.setattr(launcher, "launch_node", fake_launch_node)
    spec = JobSpec(
        kind="callable", entry="payload.pkl", num_processes=2, run_id="r", token=TOKEN, local_mode=True
    )
    outcome = driver.run_local(spec, tmp_path)
    assert outcome.ok
    assert seen == [LogLine("[torchdist] local mode: 2 process(es) on the driver")]


def test_a_stalled_owner_does_not_hold_up_the_log(tmp_path):
    """An owner that stops reading: its events beyond the queue limit are dropped, not waited for."""
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        channel.owners._queue_limit = 10
        stalled = OwnerClient(channel.address, OWNER)
        stalled._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        wait_until(lambda: channel.owners._subscribers, what="the owner to subscribe")
        for i in range(20_000):
            channel.say(f"line {i} " + "x" * 100)
        assert out.getvalue().count("\n") == 20_000
        stalled.close()


def test_an_owner_whose_hello_passed_as_the_channel_closed_still_gets_the_replay():
    """The channel told the owner "ok", then closed before its thread began to serve it (a run that
    ended as its owner connected; seen as a flaky test under load): the owner gets the replay, then
    the end, never an empty stream."""
    from airflow_provider_torchdist.spark.driver.owner import OwnerHub
    from airflow_provider_torchdist.spark.wire.protocol import decode

    hub = OwnerHub()
    for i in range(3):
        hub.publish(LogLine(f"line {i}"))
    hub.close()
    served, owner = socket.socketpair()
    owner.settimeout(10)  # an owner left waiting fails here, not hangs
    with served, owner:
        hub.serve(served)
        received = owner.makefile("rb").read().splitlines()
    assert [decode(raw) for raw in received] == [LogLine(f"line {i}") for i in range(3)]
