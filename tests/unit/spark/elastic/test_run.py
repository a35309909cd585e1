"""Elastic runs on the Spark side: the world-size history, rank 0's generation on the run channel,
torchrun's MIN:MAX configuration, and the forced restart through the driver's store."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from airflow_provider_torchdist.spark.driver.channel import ChannelClient, RunChannel
from airflow_provider_torchdist.spark.elastic.task import RESTART_KEY, RendezvousStore
from airflow_provider_torchdist.spark.elastic.world_sizes import WorldSizeHistory
from airflow_provider_torchdist.spark.node.launcher import (
    KEEP_ALIVE_MAX_ATTEMPTS,
    launch_config,
    rank_environment,
)
from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE, JobSpec
from airflow_provider_torchdist.spark.wire.protocol import ProtocolError, WorldSize, decode, encode
from tests.unit.conftest import fast_shutdown, wait_until

TOKEN = "the-run-secret"
HOST = "localhost"


def _spec(**fields) -> JobSpec:
    base = dict(kind="callable", entry="payload.pkl", num_processes="2:4", run_id="run-1", token="t")
    return JobSpec(**{**base, **fields})


# The history


def test_the_history_has_the_start_and_each_change_with_its_reason() -> None:
    said: list[str] = []
    history = WorldSizeHistory(say=said.append)
    assert history.generation(4, at=100.0) == 0
    history.node_lost("10.0.0.12", at=101.0)
    assert history.generation(3, at=105.0) == 1
    assert history.generation(3, at=110.0) == 2  # a rank failed and was restarted: same size
    assert history.generation(4, at=120.0) == 3  # a node came back

    assert history.entries == [
        {"time": 100.0, "world_size": 4, "reason": "start"},
        {"time": 105.0, "world_size": 3, "reason": "lost the node on 10.0.0.12"},
        {"time": 120.0, "world_size": 4, "reason": "a node joined"},
    ]
    assert said == [
        "elastic: training starts with world size 4",
        "elastic: Spark lost the executor on 10.0.0.12 at 00:01:41 UTC; the surviving ranks restart "
        "from the latest checkpoint and meet again without it",
        "elastic: world size 4 -> 3 (lost the node on 10.0.0.12)",
        "elastic: worker group restarted at world size 3 (restart after a failure)",
        "elastic: world size 3 -> 4 (a node joined)",
    ]
    assert history.describe_losses() == "the node on 10.0.0.12 (lost at 00:01:41 UTC)"


def test_two_losses_before_the_next_generation_are_both_its_reason() -> None:
    history = WorldSizeHistory()
    history.generation(3)
    history.node_lost("a")
    history.node_lost("b")
    history.generation(1)
    assert history.entries[-1]["reason"] == "lost the node on a; lost the node on b"


# The message


@pytest.mark.parametrize("raw", [{"n": 0}, {"n": -1}, {"n": "2"}, {"n": True}, {"n": 1 << 21}, {}])
def test_a_bad_world_size_message_is_refused(raw) -> None:
    with pytest.raises(ProtocolError):
        decode(json.dumps({"k": "world_size", **raw}))


def test_the_world_size_message_round_trips() -> None:
    assert decode(encode(WorldSize(3))) == WorldSize(3)


# The channel


@pytest.fixture
def elastic_channel(tmp_path):
    history = WorldSizeHistory()
    out = io.StringIO()
    channel = fast_shutdown(
        RunChannel(
            TOKEN,
            "127.0.0.1",
            tmp_path,
            out=out,
            ranks_of_node=lambda _: range(4),
            on_world_size=history.generation,
        )
    )
    with channel:
        yield channel, history, out


def _rank(channel: RunChannel, node: int, rank: int, generation: int = 0) -> ChannelClient:
    key = channel.registry._nodes[node].key if node in channel.registry._nodes else None
    key = key or channel.registry.add_local(node, HOST).key
    return ChannelClient.as_rank(
        channel.address, TOKEN, node=node, rank=rank, generation=generation, host=HOST, node_key=key
    )


def _output(client: ChannelClient, data: bytes) -> None:
    import hashlib

    client.output(data, format="cloudpickle", type="bytes", sha256=hashlib.sha256(data).hexdigest())


def test_the_last_generations_rank_0_delivers_even_from_another_node_with_a_lower_restart_count(
    elastic_channel, tmp_path
) -> None:
    channel, history, _ = elastic_channel
    first = _rank(channel, node=0, rank=0, generation=1)
    first.send(WorldSize(2))
    _output(first, b"generation 0")
    first.close()
    # The next generation's rank 0 runs on a node that joined later: its restart count is 0.
    second = _rank(channel, node=1, rank=0, generation=0)
    second.send(WorldSize(1))
    _output(second, b"generation 1")
    second.close()
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"generation 1"
    assert [e["world_size"] for e in history.entries] == [2, 1]


def test_rank_0_must_say_its_world_size_before_its_output(elastic_channel, tmp_path) -> None:
    channel, history, out = elastic_channel
    client = _rank(channel, node=0, rank=0)
    _output(client, b"no generation")
    client.close()
    wait_until(lambda: "before its world size" in out.getvalue(), what="the refusal")
    assert not (tmp_path / OUTPUT_FILE).exists()
    assert history.entries == []


@pytest.mark.parametrize("rank, twice", [(1, False), (0, True)], ids=["not-rank-0", "second-message"])
def test_only_rank_0_opens_a_generation_and_only_once(elastic_channel, rank, twice) -> None:
    channel, history, out = elastic_channel
    client = _rank(channel, node=0, rank=rank)
    client.send(WorldSize(2))
    if twice:
        client.send(WorldSize(3))
    client.close()
    wait_until(lambda: "broke" in out.getvalue(), what="the refusal")
    assert [e["world_size"] for e in history.entries] == ([2] if twice else [])


# torchrun's configuration


def test_an_elastic_node_is_torchruns_min_max_with_c10d_on_the_drivers_store(tmp_path) -> None:
    spec = _spec(num_processes="2:6", nproc_per_node=2, join_window=7, rendezvous_timeout=42, max_restarts=3)
    config = launch_config(
        spec, node_rank=1, master=None, host="10.0.0.3", log_dir=str(tmp_path), store=("10.0.0.1", 4321)
    )
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 3, 2)
    assert config.rdzv_backend == "torchdist-c10d"  # torch's c10d, its state signed
    assert config.rdzv_endpoint == "10.0.0.1:4321"
    assert config.rdzv_configs["is_host"] is False  # the driver hosts it: no node may be needed for it
    assert config.rdzv_configs["last_call_timeout"] == 7  # join_window
    assert config.rdzv_configs["join_timeout"] == 42  # rendezvous_timeout
    assert config.rdzv_configs["keep_alive_max_attempt"] == KEEP_ALIVE_MAX_ATTEMPTS
    assert config.max_restarts == 3
    assert config.local_addr == "10.0.0.3"


def test_elastic_ranks_get_a_fresh_process_group_store_each_generation(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert rank_environment(_spec(), "127.0.0.1", 1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in rank_environment(
        _spec(num_processes=2), "127.0.0.1", 1
    )


# The forced restart, with a real store and a real process tree

AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from airflow_provider_torchdist.spark.elastic.task import RestartWatch
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with RestartWatch(("127.0.0.1", int(sys.argv[1])), 30, bytes.fromhex(sys.argv[2])) as watch:
        print(worker.pid, flush=True)
        code = worker.wait()
        print(code, watch.restarts, flush=True)
        # A worker started after the bump is left alone.
        later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
        print(later.wait(), watch.restarts, flush=True)
    """
)


def test_a_bump_of_the_drivers_counter_stops_the_workers_the_agent_had(tmp_path) -> None:
    store = RendezvousStore("127.0.0.1", timeout=30)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(store.address[1]), store.key.hex()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert agent.stdout is not None
        worker = int(agent.stdout.readline())
        # A stranger who reaches the store writes a request of its own: ignored (not signed).
        stranger = TCPStore("127.0.0.1", store.address[1], is_master=False, timeout=timedelta(seconds=5))
        stranger.set(RESTART_KEY, json.dumps({"n": 99, "before": time.time() + 60}))
        time.sleep(1.0)
        assert _alive(worker)
        started = time.monotonic()
        assert store.restart_survivors(lost_at=time.time()) == 1
        assert agent.stdout.readline().split() == ["-9", "1"]  # SIGKILLed, one restart
        assert time.monotonic() - started < 5
        assert agent.stdout.readline().split() == ["0", "1"]
        assert agent.wait(timeout=10) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:
        agent.kill()
        agent.wait()


MID_WRITE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from airflow_provider_torchdist.spark.elastic.task import stop_workers_started_before

    root = sys.argv[1]
    # A rank killed while torch writes its error file in place: open, part written, not closed.
    writing = os.path.join(root, "0", "error.json")
    # A rank that wrote its error file whole, and is killed before it exits.
    written = os.path.join(root, "1", "error.json")
    code = (
        "import json, sys, time; f = open(sys.argv[1], 'w'); f.write('{\\"message\\": {\\"mess');"
        "f.flush(); time.sleep(60)"
    )
    whole = "import json, sys, time; json.dump({'message': 'ValueError: boom'}, open(sys.argv[1], 'w')); time.sleep(60)"
    for path in (writing, written):
        os.makedirs(os.path.dirname(path))
    workers = [subprocess.Popen([sys.executable, "-c", c, p]) for c, p in ((code, writing), (whole, written))]
    while not all(os.path.getsize(p) if os.path.exists(p) else 0 for p in (writing, written)):
        time.sleep(0.05)
    time.sleep(0.2)
    stopped = stop_workers_started_before(time.time() + 1)
    for w, path in zip(workers, (writing, written)):
        # What the agent does next with a dead worker: read its error file.
        failure = ProcessFailure(local_rank=0, pid=w.pid, exitcode=w.wait(), error_file=path)
        print(json.dumps([w.pid in stopped, failure.exitcode, failure.message]), flush=True)
    """
)


def test_a_rank_killed_while_writing_its_error_file_does_not_fail_its_agent(tmp_path) -> None:
    """Hunt 21: a survivor's rank, failing on its lost peer, was SIGKILLed by the restart request
    while torch wrote its error file in place; the agent then failed reading the truncated file
    (JSONDecodeError), where it should have restarted the worker."""
    done = subprocess.run(
        [sys.executable, "-c", MID_WRITE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr
    killed_mid_write, killed_after = (json.loads(line) for line in done.stdout.splitlines())
    assert killed_mid_write[:2] == [True, -9]
    assert killed_mid_write[2].startswith("Signal 9 (SIGKILL) received by PID")
    assert killed_after[:2] == [True, -9]
    assert "ValueError: boom" in killed_after[2]  # a whole error file is kept: the rank's own error


def test_the_drivers_store_listens_only_on_its_address() -> None:
    import psutil

    store = RendezvousStore("127.0.0.1", timeout=5)
    listening = {
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.address[1]
    }
    assert {a.ip for a in listening} == {"127.0.0.1"}


def test_a_loss_noticed_after_the_smaller_group_formed_still_explains_it() -> None:
    history = WorldSizeHistory()
    history.generation(4)
    history.generation(2)  # the survivors met again before Spark reported the loss
    history.node_lost("10.0.0.12")
    history.generation(4)  # and the node came back
    assert [(e["world_size"], e["reason"]) for e in history.entries] == [
        (4, "start"),
        (2, "lost the node on 10.0.0.12"),
        (4, "a node joined"),
    ]


def test_a_loss_taken_in_by_a_same_size_group_does_not_label_a_later_change() -> None:
    history = WorldSizeHistory()
    history.generation(2)
    history.node_lost("a")
    history.generation(2)  # a replacement joined at once
    history.generation(1)  # later, a node left for another reason
    assert [(e["world_size"], e["reason"]) for e in history.entries] == [(2, "start"), (1, "a node left")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_planted_rendezvous_state_is_refused_before_torch_unpickles_it(tmp_path) -> None:
    """A stranger who reaches the driver's store writes a pickle as the rendezvous state: the
    agents' backend refuses it for its tag, and nothing of it is unpickled."""
    import base64
    import pickle

    from torch.distributed.elastic.rendezvous import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from airflow_provider_torchdist.spark.node.signed_rendezvous import SignedBackend, run_key

    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store = RendezvousStore("127.0.0.1", timeout=5)
    client = TCPStore("127.0.0.1", store.address[1], is_master=False, timeout=timedelta(seconds=5))
    backend = SignedBackend(C10dRendezvousBackend(client, "run-1"), run_key(store.key, "rendezvous"))
    assert backend.get_state() is None  # nothing yet
    state, token, written = backend.set_state(b"the agents' state")
    assert (state, written) == (b"the agents' state", True)
    assert backend.get_state()[0] == b"the agents' state"

    stranger = TCPStore("127.0.0.1", store.address[1], is_master=False, timeout=timedelta(seconds=5))
    stranger.set("torch.rendezvous.run-1", base64.b64encode(pickle.dumps(Planted())))
    with pytest.raises(RendezvousStateError, match="not signed with this run's key"):
        backend.get_state()
    # Signed with another run's key: refused too.
    other = SignedBackend(C10dRendezvousBackend(client, "run-2"), run_key(b"another run's key", "rendezvous"))
    other.set_state(b"x")
    with pytest.raises(RendezvousStateError):
        SignedBackend(C10dRendezvousBackend(client, "run-2"), run_key(store.key, "rendezvous")).get_state()
    assert not marker.exists()


def test_a_world_size_outside_the_range_is_refused() -> None:
    from airflow_provider_torchdist.spark.elastic.run import ElasticMonitor

    monitor = ElasticMonitor(
        _spec(num_processes="2:4", nproc_per_node=2), None, lambda: None, say=lambda _: None
    )
    assert monitor.world_size(2) == 0
    assert monitor.world_size(4) == 1
    for bad in (1, 3, 6, 1 << 20):
        with pytest.raises(ProtocolError, match="outside num_processes"):
            monitor.world_size(bad)
    assert [e["world_size"] for e in monitor.history.entries] == [2, 4]


def test_when_no_group_forms_again_after_a_loss_the_run_is_cancelled(monkeypatch) -> None:
    from airflow_provider_torchdist.spark.elastic.run import ElasticMonitor

    class Store:
        requests: list[float] = []

        def restart_survivors(self, lost_at: float) -> int:
            self.requests.append(lost_at)
            return len(self.requests)

    cancelled = []
    monkeypatch.setattr(ElasticMonitor, "MARGIN_S", 0.0)
    spec = _spec(num_processes="1:2", rendezvous_timeout=1, join_window=1)
    monitor = ElasticMonitor(spec, Store(), lambda: cancelled.append(1), say=lambda _: None)
    monitor.world_size(2)
    monitor.lost({"10.0.0.2:4040": "10.0.0.2"})
    monitor.lost({"10.0.0.2:4040": "10.0.0.2"})  # the same loss again: nothing more
    assert len(Store.requests) == 1
    wait_until(lambda: cancelled, timeout=10, what="the cancel")
    assert monitor.gave_up

    # A group that forms again in time keeps the run going.
    cancelled.clear()
    monitor = ElasticMonitor(spec, Store(), lambda: cancelled.append(1), say=lambda _: None)
    monitor.world_size(2)
    monitor.lost({"10.0.0.3:4040": "10.0.0.3"})
    monitor.world_size(1)
    time.sleep(3.0)
    assert not cancelled and not monitor.gave_up


def test_a_decommissioned_node_that_left_restarts_every_rank_now_and_its_executors_end_is_no_loss() -> None:
    from airflow_provider_torchdist.spark.elastic.run import ElasticMonitor

    class Store:
        def __init__(self) -> None:
            self.requests: list[float] = []

        def restart_survivors(self, lost_at: float) -> int:
            self.requests.append(lost_at)
            return len(self.requests)

    store, lines = Store(), []
    monitor = ElasticMonitor(
        _spec(num_processes="2:4", nproc_per_node=2), store, lambda: None, say=lines.append
    )
    monitor.world_size(4)
    before = time.time()
    monitor.left({"10.0.0.12:40002": "10.0.0.12"})
    # Every rank waits after its checkpoint: all of them restart (none started after "now").
    assert len(store.requests) == 1 and store.requests[0] >= before
    monitor.lost({"10.0.0.12:40002": "10.0.0.12"})  # the decommissioned executor ends later
    assert len(store.requests) == 1
    monitor.world_size(2)
    assert monitor.history.entries[-1]["reason"] == "the node on 10.0.0.12 was decommissioned"
    assert any(
        "elastic: the node on 10.0.0.12 left at" in line and "(decommissioned)" in line for line in lines
    )


@pytest.mark.parametrize(
    ("failure", "why"),
    [
        (dict(rank=None, exc_type="RendezvousTimeout"), "fewer than MIN=2 ranks remained"),
        (dict(rank=1, exc_type="RuntimeError"), "a node used up its max_restarts=3"),
        # Hunt 21: the agent failed on its own; "out of restarts" would have been wrong.
        (dict(rank=None, exc_type="JSONDecodeError"), "a surviving node's torchrun agent failed"),
    ],
)
def test_the_verdict_after_a_loss_says_why_the_run_could_not_go_on(failure, why) -> None:
    from types import SimpleNamespace

    from airflow_provider_torchdist.spark.elastic.run import elastic_verdict
    from airflow_provider_torchdist.spark.wire.outcome import RankFailure

    history = WorldSizeHistory()
    history.generation(2)
    history.node_lost("10.0.0.12", at=0.0)
    said: list[str] = []
    failures = [RankFailure(host="10.0.0.11", message="m", **failure)]
    error = elastic_verdict(
        _spec(num_processes="2:3", max_restarts=3),
        SimpleNamespace(gave_up=False, history=history),
        failures,
        said.append,
    )
    assert error == said[0]
    assert error.startswith(
        "the elastic run could not go on after losing the node on 10.0.0.12 (lost at 00:00:00 UTC): "
    )
    assert why in error
