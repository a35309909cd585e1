"""A hang in an elastic run is a node loss (spark/elastic/hung_nodes.py): the driver's side over a real
run channel and hang watch, and the node's side with a real store and a real process tree (real
elastic runs: tests/integration/test_worker_loss.py)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from airflow_provider_torchdist.spark.driver.hang_watch import HangWatch
from airflow_provider_torchdist.spark.elastic.hung_nodes import LEFT_HUNG, HungNodes
from airflow_provider_torchdist.spark.elastic.run import ElasticMonitor
from airflow_provider_torchdist.spark.elastic.task import RendezvousStore
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.protocol import Message, StackRequest, StopAnswer, StopRequest
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress, Stacks
from tests.unit.conftest import wait_until
from tests.unit.spark.driver.test_channel import Channel, make_channel


def _spec(num_processes: str = "2:4") -> JobSpec:
    return JobSpec(
        kind="callable", entry="p.pkl", num_processes=num_processes, nproc_per_node=2, run_id="r", token="t"
    )


class Store:
    """The driver's store as :class:`HungNodes` and :class:`ElasticMonitor` use it; ``on_leave``
    stands for the named nodes' agents killing their ranks."""

    def __init__(self, on_leave) -> None:
        self.requests: list[tuple[str, object]] = []
        self._on_leave = on_leave

    def leave(self, nodes: list[int]) -> int:
        self.requests.append(("leave", nodes))
        self._on_leave(nodes)
        return len(self.requests)

    def restart_survivors(self, lost_at: float) -> int:
        self.requests.append(("restart", lost_at))
        return len(self.requests)


def _rank(ch: Channel, rank: int, waits_in: str | None):
    """A rank (node ``rank // 2``) that reports once, then answers for its stacks and for a stop."""
    client = ch.client(rank)
    client.send(Progress(1, 1, None, f"train.py:{10 + rank} in train", waits_in, 1000 + rank))

    def on_message(message: Message) -> None:
        if isinstance(message, StackRequest):
            stack = f'main thread, most recent call last:\n  File "train.py", line {10 + rank}, in train\n'
            client.send(Stacks(stack, f"train.py:{10 + rank} in train", waits_in))
        elif isinstance(message, StopRequest):
            client.send(StopAnswer(False))

    client.listen(on_message)
    return client


def test_a_hung_elastic_node_leaves_and_the_run_goes_on_until_no_node_can_be_singled_out(tmp_path):
    out = io.StringIO()
    with make_channel(tmp_path, out) as channel:
        ch = Channel(channel, out, [])
        # Node 0 (ranks 0, 1) waits in all_reduce; on node 1 rank 2 sleeps in user code.
        waits = {0: "all_reduce", 1: "all_reduce", 2: None, 3: "all_reduce"}
        clients = {rank: _rank(ch, rank, waits_in) for rank, waits_in in waits.items()}
        wait_until(lambda: len(channel.hangs.pids()) == 4, what="the four ranks' progress")

        def kill_ranks_of(nodes: list[int]) -> None:  # what the named agents do: their ranks die
            for rank in [r for r in clients if r // 2 in nodes]:
                clients.pop(rank).close()

        store = Store(kill_ranks_of)
        monitor = ElasticMonitor(_spec(), store, lambda: None, say=channel.say)
        monitor.world_size(4)
        hung = HungNodes(_spec(), store, monitor, channel.hangs, channel.say, leave_timeout=10.0)
        ended: list[list[int]] = []
        watch = HangWatch(
            channel.hangs, channel.stops, channel.say, hang_timeout=30.0, grace=60.0,
            hard_stop=ended.append, stacks_wait=5.0, survive=hung,
        )  # fmt: skip
        before = time.time()
        assert watch.check(now=time.monotonic() + 31) is False  # survived: the run goes on
        assert watch.error is None and watch.verdict is None and not ended
        assert channel.stops.request is None  # no rank was asked to stop
        assert store.requests[0] == ("leave", [1])
        # The survivors that started before the request are restarted; the loss is in the history.
        kind, lost_at = store.requests[1]
        assert kind == "restart" and before <= lost_at <= time.time()  # type: ignore[operator]
        assert monitor.world_size(2) == 1
        assert monitor.history.entries[-1]["reason"] == "the node on localhost hung"
        # The watch starts over on the ranks left: a fresh hang_timeout from now.
        assert watch.check(now=time.monotonic() + 10) is False and not store.requests[2:]
        # Now both ranks left wait in a collective: nobody to single out, the run fails as a fixed one.
        assert watch.check(now=time.monotonic() + 31) is True
        assert watch.error is not None and "every rank waits in a collective" in watch.error
        assert sorted(ended[0]) == [1000, 1001]
        assert len(store.requests) == 2  # no second leave
        for client in clients.values():
            client.close()
    text = out.getvalue()
    assert (
        "hang: suspect: rank 2 on localhost (not in a collective, or silent, while rank(s) [0, 1, 3]" in text
    )
    assert (
        "hang: elastic run: node 1 on localhost leave(s) the run as a lost node: its ranks are killed, and "
        "the other ranks restart from the latest checkpoint and meet again without it"
    ) in text
    assert "elastic: the node on localhost left at" in text and "(hung: its ranks were killed)" in text
    assert (
        "hang: elastic run: no rank can be singled out; the run is stopped, as a fixed run would be" in text
    )


def _verdict(ranks: dict[int, tuple[int, str | None]]):
    """A verdict over ``{rank: (node, what it waits in)}``, every rank answering."""
    from airflow_provider_torchdist.spark.driver.hang_detection import HangVerdict, RankProgress

    states = [
        RankProgress(r, f"10.0.0.{node}", 0.0, 0.0, node=node, stacks=Stacks("", f"t.py:{r} in f", waits))
        for r, (node, waits) in ranks.items()
    ]
    return HangVerdict(30.0, sorted(ranks), states, 40.0)


@pytest.mark.parametrize(
    ("ranks", "num_processes", "why"),
    [
        ({0: (0, None), 1: (1, None)}, "1:2", "every node holds a suspect, so none would be left to go on"),
        ({0: (0, "all_reduce"), 1: (1, "broadcast")}, "1:2", "no rank can be singled out"),
        ({0: (0, "all_reduce"), 1: (1, None)}, "2:4", "only 1 rank(s) would be left, fewer than MIN=2"),
    ],
)
def test_no_node_leaves_when_the_run_could_not_go_on_without_it(ranks, num_processes, why) -> None:
    lines: list[str] = []
    store = Store(lambda nodes: pytest.fail("no node may be told to leave"))
    hung = HungNodes(_spec(num_processes), store, None, None, lines.append)  # type: ignore[arg-type]
    assert hung(_verdict(ranks)) is False
    assert not store.requests
    assert lines == [f"hang: elastic run: {why}; the run is stopped, as a fixed run would be"]


def test_one_suspect_rank_takes_its_whole_node_with_it() -> None:
    hung = HungNodes(_spec("2:6"), None, None, None, lambda _: None)  # type: ignore[arg-type]
    verdict = _verdict({0: (0, "all_reduce"), 1: (0, "all_reduce"), 2: (1, "all_reduce"), 3: (1, None)})
    assert hung.nodes_to_drop(verdict) == {1: "10.0.0.1"}


# The node's side: a real store, a real agent process with a worker and torch's kind of handler.

AGENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from airflow_provider_torchdist.spark.elastic.task import RestartWatch

    class SignalException(Exception):
        pass

    def handler(signum, frame):  # torch's agent raises this from its handler
        raise SignalException(signum)

    signal.signal(signal.SIGTERM, handler)
    node = int(sys.argv[3])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with RestartWatch(("127.0.0.1", int(sys.argv[1])), 30, bytes.fromhex(sys.argv[2]), node=node) as watch:
        print(worker.pid, flush=True)
        try:
            while True:  # the agent's monitor loop
                time.sleep(0.1)
        except SignalException as exc:
            print("agent stopped by", signal.Signals(exc.args[0]).name, worker.wait(), watch.left, flush=True)
    """
)


def test_a_node_told_to_leave_kills_its_ranks_and_stops_its_agent_and_another_node_is_left_alone() -> None:
    store = RendezvousStore("127.0.0.1", timeout=30)
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", AGENT, str(store.address[1]), store.key.hex(), str(node)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
        )
        for node in (0, 1)
    ]
    try:
        workers = [int(agent.stdout.readline()) for agent in agents]  # type: ignore[union-attr]
        os.kill(workers[1], signal.SIGSTOP)  # a frozen rank dies too
        started = time.monotonic()
        store.leave([1])
        assert agents[1].stdout.readline().split() == ["agent", "stopped", "by", "SIGTERM", "-9", "True"]  # type: ignore[union-attr]
        assert time.monotonic() - started < 5
        assert agents[1].wait(timeout=10) == 0
        # Node 0 was not named: its worker runs on, its agent restarted nothing.
        time.sleep(1.0)
        os.kill(workers[0], 0)
        assert agents[0].poll() is None
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_node_that_left_hung_reports_a_signal_its_task_takes_as_leaving() -> None:
    from airflow_provider_torchdist.spark.elastic.hung_nodes import left_hung

    failure = left_hung("10.0.0.2")
    assert failure.exc_type == "SignalException" and failure.message == LEFT_HUNG and failure.rank is None
