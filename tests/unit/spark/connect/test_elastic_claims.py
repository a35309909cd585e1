"""Issue 40, item 5: who may claim a node of an elastic run over Spark Connect, and who may seal
its rendezvous state. The driver's side is the real one (``NodeWatch`` on a real ``RunChannel``
and a real ``RendezvousStore``, over real sockets); the nodes are real ``ChannelClient``s, and the
attacker speaks the channel's hello on a raw socket, as anyone holding the run's token could."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import pickle
import socket
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from airflow_provider_torchdist.spark.connect.elastic import NodeWatch
from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.elastic.task import RendezvousStore
from airflow_provider_torchdist.spark.node.channel_client import ChannelClient, ChannelRefused
from airflow_provider_torchdist.spark.wire.channel_auth import PROTOCOL_VERSION, read_json, send_json
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.node_claims import claim_proof
from airflow_provider_torchdist.spark.wire.protocol import NodeLeft, NodeStarted
from tests.unit.conftest import fast_shutdown, wait_until

TOKEN = "the-run-token-every-task-holds"


@pytest.fixture
def run(tmp_path):
    """An elastic run's driver side over Connect, as ``run_connect_elastic`` wires it: 2 nodes,
    max_restarts=1 (so at most 2 comebacks in all)."""
    spec = JobSpec(
        kind="callable", entry="payload.pkl", num_processes="1:2", run_id="run-1", token=TOKEN, max_restarts=1
    )
    store = RendezvousStore("127.0.0.1", timeout=30)
    said: list[str] = []
    stopped: list[bool] = []
    watch = NodeWatch(spec, store, lambda: stopped.append(True), say=said.append)
    channel = RunChannel(
        TOKEN,
        "127.0.0.1",
        tmp_path,
        watch.stop,
        out=open("/dev/null", "w"),  # noqa: SIM115 (closed with the process)
        ranks_of_node=lambda _: range(2),
        verify_node=watch.verifier,
        on_node_gone=watch.node_gone,
    )
    watch.attach(channel, store.key)
    fast_shutdown(channel)
    with channel:
        yield channel, watch, store, said


def _claim(channel: RunChannel, watch: NodeWatch, node: int, attempt: int) -> ChannelClient:
    """Node ``node``'s task, with its own claim secret (what its input row carries), claims it."""
    return ChannelClient.as_node(
        channel.address,
        TOKEN,
        node=node,
        task_attempt=attempt,
        host=None,
        claim_secret=watch.verifier.claim_secret(node),
    )


def _leave(client: ChannelClient, watch: NodeWatch, losses: int) -> None:
    """The node says it leaves (as a stopped elastic task does), and the driver counts the loss."""
    client.send(NodeLeft())
    client.close()
    wait_until(lambda: len(watch.monitor.history.losses) == losses, what=f"loss {losses}")


def _raw_claim(address: tuple[str, int], hello: dict, proof) -> tuple[str, dict]:
    """A node claim spoken on a raw socket, as anyone holding the run's token can: the hello, then
    ``proof(nonce)`` as the answer to the driver's challenge. Returns the nonce and the answer."""
    with socket.create_connection(address, timeout=5) as sock:
        send_json(sock, {"v": PROTOCOL_VERSION, "token": TOKEN, "role": "node", **hello})
        reply = read_json(sock, time.monotonic() + 5)
        assert "key" not in reply and "elastic_key" not in reply, "a key for the token alone"
        send_json(sock, {"proof": proof(reply["nonce"])})
        answer = read_json(sock, time.monotonic() + 5)
        if "key" in answer:
            sock.sendall(b'{"t": "bye"}\n')
        return reply["nonce"], answer


def test_the_runs_token_alone_claims_no_node(run) -> None:
    """Before: the token was the node credential over Connect; a token holder claimed a node that
    had not started and got its node key (and could seal the rendezvous state). Now the driver
    challenges the claim, and only the node's own claim secret answers it."""
    channel, watch, _, _ = run
    hello = {"node": 1, "task": 7, "host": None}
    # The best a token holder can do: a key derived from the token, or another node's secret.
    for guess in (hashlib.sha256(TOKEN.encode()).digest(), watch.verifier.claim_secret(0)):
        _, answer = _raw_claim(channel.address, hello, lambda nonce, g=guess: claim_proof(g, nonce, hello))
        assert "key" not in answer
        assert "did not prove it holds that node's own claim secret" in answer["error"]
    assert channel.registry.current(1) is None
    # An honest client without a secret is refused too, saying why.
    with pytest.raises(ChannelRefused, match="carries no claim secret"):
        ChannelClient.as_node(channel.address, TOKEN, node=1, task_attempt=8, host=None)
    # And node 1's own task is taken.
    assert _claim(channel, watch, 1, 9).elastic_key is not None


def test_a_recorded_claim_is_not_replayed_and_the_keys_it_carried_are_wrapped(run) -> None:
    """A sniffer of the executors' network records a real claim: its proof answers that
    connection's nonce only, and the keys in the driver's answer are wrapped under the node's
    secret, which never crossed the network."""
    channel, watch, store, _ = run
    secret = watch.verifier.claim_secret(0)
    hello = {"node": 0, "task": 3, "host": None}
    recorded: list[str] = []
    nonce, answer = _raw_claim(
        channel.address, hello, lambda n: recorded.append(claim_proof(secret, n, hello)) or recorded[0]
    )
    assert bytes.fromhex(answer["elastic_key"]) != store.key  # what the sniffer saw
    assert bytes.fromhex(answer["key"]) != channel.registry.current(0).key
    replayed_nonce, replayed = _raw_claim(channel.address, hello, lambda _: recorded[0])
    assert replayed_nonce != nonce
    assert "did not prove" in replayed["error"]


def test_claim_leave_claim_spends_at_most_the_runs_comebacks_in_all(run) -> None:
    """Before: each node could come back max_restarts + 1 times, so the run as a whole could be
    made to lose (and restart for) nodes x (max_restarts + 1) times. Now the comebacks are the
    run's: max_restarts + 1 = 2 in all, whichever nodes claim, leave and claim again."""
    channel, watch, _, said = run
    node0 = _claim(channel, watch, 0, 1)
    node0.send(NodeStarted())
    node1 = _claim(channel, watch, 1, 2)
    _leave(node1, watch, losses=1)
    node1 = _claim(channel, watch, 1, 3)  # comeback 1
    _leave(node1, watch, losses=2)
    node1 = _claim(channel, watch, 1, 4)  # comeback 2
    _leave(node1, watch, losses=3)
    with pytest.raises(ChannelRefused, match="past the run's 2 comeback"):
        _claim(channel, watch, 1, 5)
    _leave(node0, watch, losses=4)  # another node's comeback is past the run's budget too
    with pytest.raises(ChannelRefused, match=r"past the run's 2 comeback\(s\) in all \(2 taken\)"):
        _claim(channel, watch, 0, 6)
    assert watch.verifier.comebacks == 2
    assert sum("past the run's 2 comeback" in line for line in said) == 2


def test_a_token_holder_cannot_seal_a_rendezvous_state_the_agents_unpickle(run, tmp_path) -> None:
    """Before: the rendezvous state's key was derived from the run's token, so a token holder who
    reached the store could seal a pickle that every agent's backend accepted and torch unpickled.
    Now the key is the driver's random elastic key, handed to verified nodes only: the agents' real
    handler (``torchdist-c10d``, as torchrun creates it) refuses the planted state unread."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

    from airflow_provider_torchdist.spark.node.signed_rendezvous import BACKEND, create_handler, seal, use_key

    channel, watch, store, _ = run
    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    node = _claim(channel, watch, 0, 1)  # an agent, as elastic_task sets it up
    use_key("run-1", node.elastic_key)
    assert node.elastic_key == store.key
    params = RendezvousParameters(
        backend=BACKEND,
        endpoint=f"{store.address[0]}:{store.address[1]}",
        run_id="run-1",
        min_nodes=1,
        max_nodes=2,
        is_host=False,
    )
    handler = create_handler(params)

    # What the token gives (the old derivation: HMAC(token, "torchdist elastic rendezvous")).
    from_token = hmac.new(TOKEN.encode(), b"torchdist elastic rendezvous", hashlib.sha256).digest()
    attacker = TCPStore(*store.address, is_master=False, timeout=timedelta(seconds=5))
    attacker.set("torch.rendezvous.run-1", base64.b64encode(seal(from_token, pickle.dumps(Planted()))))
    with pytest.raises(RendezvousStateError, match="not signed with this run's key"):
        handler.num_nodes_waiting()  # the agent reads the state: refused before torch unpickles it
    assert not marker.exists()
    assert store.key.hex() not in json.dumps(params.config)  # torch logs the configuration
