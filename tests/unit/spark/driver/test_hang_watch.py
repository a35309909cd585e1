"""The driver's hang watch over a real run channel: real rank connections, real stop fanout; a rank
that never answers stands for a frozen one (real ranks: tests/integration/test_hangs.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

from airflow_provider_torchdist.spark.driver.hang_watch import HUNG, HangWatch, kill_own_children, parent_of
from airflow_provider_torchdist.spark.wire.protocol import Message, StackRequest, StopAnswer, StopRequest
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress, Stacks
from tests.unit.conftest import wait_until
from tests.unit.spark.driver.test_channel import Channel, make_channel


def _rank(ch: Channel, rank: int, waits_in: str | None, answers: bool, heard: list[Message]):
    """A rank that reports once, then answers for its stacks (unless ``answers`` is False: frozen)
    and answers a stop saying its code does not watch for stops."""
    client = ch.client(rank)
    client.send(Progress(1, 1, None, f"train.py:{10 + rank} in train", waits_in, 1000 + rank))

    def on_message(message: Message) -> None:
        heard.append(message)
        if not answers:
            return
        if isinstance(message, StackRequest):
            stack = f'main thread, most recent call last:\n  File "train.py", line {10 + rank}, in train\n'
            client.send(Stacks(stack, f"train.py:{10 + rank} in train", waits_in))
        elif isinstance(message, StopRequest):
            client.send(StopAnswer(False))

    client.listen(on_message)
    return client


def test_a_hung_run_gets_stacks_suspects_a_stop_and_its_end_without_waiting_for_a_frozen_rank(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        ch = Channel(channel, out, [])
        heard: dict[int, list[Message]] = {0: [], 1: [], 2: []}
        clients = [
            _rank(ch, 0, "all_reduce", True, heard[0]),
            _rank(ch, 1, None, True, heard[1]),
            _rank(ch, 2, None, False, heard[2]),  # frozen: it hears, but never answers
        ]
        wait_until(lambda: len(channel.hangs.pids()) == 3, what="the three ranks' progress")
        ended: list[list[int]] = []
        watch = HangWatch(
            channel.hangs,
            channel.stops,
            channel.say,
            hang_timeout=30.0,
            grace=60.0,  # not waited out: every live rank says its code does not watch for stops
            hard_stop=ended.append,
            stacks_wait=5.0,  # the live ranks' answers, on a loaded machine too
        )
        assert watch.check(now=time.monotonic() + 10) is False  # not yet
        started = time.monotonic()
        assert watch.check(now=time.monotonic() + 31) is True
        assert time.monotonic() - started < 20  # one stacks wait, not the 60 s grace period
        assert sorted(ended[0]) == [1000, 1001, 1002]
        # The frozen rank's requests were sent, not waited for: its listener may hear them a moment later.
        wait_until(
            lambda: all(len(got) >= 2 for got in heard.values()), what="every rank hearing both requests"
        )
        for got in heard.values():
            assert got[:2] == [StackRequest(), StopRequest(HUNG, 60.0)]
        for client in clients:
            client.close()
    text = out.getvalue()
    assert "[torchdist] no progress from rank(s) [0, 1, 2] for hang_timeout=30 s: the run looks hung" in text
    assert "[torchdist] stacks of [rank 1 @ localhost]:" in text
    assert '[torchdist]     File "train.py", line 11, in train' in text
    assert (
        "hang: [rank 0 @ localhost] waits in a collective (torch.distributed all_reduce) at train.py:10"
        in text
    )
    assert "hang: [rank 2 @ localhost] is silent" in text and "last seen at train.py:12 in train" in text
    assert "hang: suspect: rank 1 on localhost, rank 2 on localhost (not in a collective, or silent" in text
    assert "[torchdist] the stop request (hung) goes to 3 rank(s)" in text
    assert "[torchdist] ending what is left of the hung run: its ranks are killed" in text
    assert watch.error is not None and watch.error.startswith(
        "training hung: no progress from rank(s) [0, 1, 2]"
    )
    assert "(rank 1 at train.py:11 in train; rank 2: silent)" in watch.error


def test_a_run_stopping_already_or_with_the_watch_off_is_never_called_hung(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        ch = Channel(channel, out, [])
        client = _rank(ch, 0, None, True, [])
        wait_until(lambda: channel.hangs.pids(), what="progress")
        off = HangWatch(
            channel.hangs, channel.stops, channel.say, hang_timeout=None, grace=1, hard_stop=print
        )
        assert off.check(now=time.monotonic() + 1e6) is False
        channel.stops.stop("timeout", 1.0)  # the owner's stop: its stopper ends the run
        on = HangWatch(channel.hangs, channel.stops, channel.say, hang_timeout=30, grace=1, hard_stop=print)
        assert on.check(now=time.monotonic() + 1e6) is False
        client.close()
    assert "hung" not in out.getvalue()


def test_only_this_processs_own_children_are_killed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert parent_of(child.pid) == os.getpid()
        # A rank's message could name any PID: the parent of this process is not ours to kill.
        assert kill_own_children([os.getppid(), child.pid, 1, 0]) == [child.pid]
        assert child.wait(10) == -9
    finally:
        child.kill()


def test_only_a_rank_may_report_progress_or_stacks(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        ch = Channel(channel, out, [])
        agent = ch.client(None)
        agent.send(Progress(1, 1, None, "x", None, 5))
        wait_until(lambda: "not allowed on this connection" in out.getvalue(), what="the refusal")
        agent.close()
        assert channel.hangs.pids() == []


def test_the_watch_adds_each_ranks_step_time_to_the_run_channels_metrics_at_its_end(tmp_path):
    """Over a real channel: two progress messages of a rank, then the watch's end adds its record."""
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        client = Channel(channel, out, []).client(0)
        client.send(Progress(2, 1, None, "train.py:9 in train", None, 1000, 1, 4, 3))
        wait_until(lambda: channel.hangs.pids(), what="progress")
        time.sleep(0.05)  # the step time is between the two messages' arrivals
        client.send(Progress(6, 2, 0.01, "train.py:9 in train", None, 1000, 2, 8, 6))
        wait_until(lambda: channel.hangs.every_rank()[0].events == 6, what="the second message")
        with HangWatch(
            channel.hangs,
            channel.stops,
            channel.say,
            hang_timeout=30,
            grace=1,
            hard_stop=print,
            publish=channel.publish_metric,
        ):
            pass
        off = HangWatch(
            channel.hangs,
            channel.stops,
            channel.say,
            hang_timeout=None,
            grace=1,
            hard_stop=print,
            publish=channel.publish_metric,
        )
        with off:  # the watchdog off: no record
            pass
        client.close()
    (record,) = channel.metrics
    assert record["rank"] == 0 and record["compute_share"] == 0.75 and 0.01 < record["mean_step_time_s"] < 1
    assert "[metrics] rank 0: summary=step_time mean_step_time_s=" in out.getvalue()
