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

import pytest

from airflow_provider_torchdist.spark.channel import ChannelClient, RunChannel
from airflow_provider_torchdist.spark.elastic import RendezvousStore
from airflow_provider_torchdist.spark.jobspec import OUTPUT_FILE, JobSpec
from airflow_provider_torchdist.spark.launcher import KEEP_ALIVE_MAX_ATTEMPTS, launch_config, rank_environment
from airflow_provider_torchdist.spark.protocol import ProtocolError, WorldSize, decode, encode
from airflow_provider_torchdist.spark.world_sizes import WorldSizeHistory
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
    assert config.rdzv_backend == "c10d"
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
    from airflow_provider_torchdist.spark.elastic import RestartWatch
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with RestartWatch(("127.0.0.1", int(sys.argv[1])), 30) as watch:
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
        [sys.executable, "-c", AGENT, str(store.address[1])],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert agent.stdout is not None
        worker = int(agent.stdout.readline())
        started = time.monotonic()
        assert store.restart_survivors() == 1
        assert agent.stdout.readline().split() == ["-9", "1"]  # SIGKILLed, one restart
        assert time.monotonic() - started < 5
        assert agent.stdout.readline().split() == ["0", "1"]
        assert agent.wait(timeout=10) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:
        agent.kill()
        agent.wait()


def test_the_drivers_store_listens_only_on_its_address() -> None:
    import psutil

    store = RendezvousStore("127.0.0.1", timeout=5)
    listening = {
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.address[1]
    }
    assert {a.ip for a in listening} == {"127.0.0.1"}
