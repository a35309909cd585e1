"""Who may talk on the run channel, and as whom: the hello, node keys, and per-connection challenges.

Every executor holds the run's token (it travels inside the Spark task), so the token only keeps
strangers out. Identity comes from elsewhere:

1. **A node** (a barrier task's torchrun agent) says which partition it runs and its Spark task
   attempt id. The driver asks Spark's scheduler which host runs that task attempt for that
   partition of this run's stage, and checks that the connection comes from that host. Only then
   does it hand the node a fresh random node key, once per task attempt. In local mode the driver
   makes node 0's key itself and gives it to the agent it runs in-process. Where no scheduler
   vouches (an elastic run over Spark Connect), the node proves instead that it holds a claim
   secret of its own (:mod:`.node_claims`), and its keys come back wrapped under it. An elastic
   run's nodes also get the run's **elastic key** (the rendezvous state's), from the driver alone.
2. **A rank** says its node, global rank and worker-group generation. The driver answers with a
   random nonce; the rank proves it holds its node's key with an HMAC over the nonce and its hello.
   The driver accepts only ranks that belong to that node, from that node's host.

So a rank claiming to be rank 0 of node 0 with node 1's key, or from node 1's host, is refused.

3. **An owner** (the Airflow side: the hook that ran ``spark-submit``) presents the owner token, a
   secret the hook wrote into the staging directory for the driver alone. It needs no run token
   and no executor ever holds it. An owner only receives: the run's log, its application and metrics.

The hello has one deadline (``HELLO_TIMEOUT_S``) for all of it, and at most
``MAX_UNAUTHENTICATED`` connections may be in their hello at once. Standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_provider_torchdist.spark.wire.node_claims import claim_proof, wrap_key
from airflow_provider_torchdist.spark.wire.peer_hosts import peer_matches, same_host

HELLO_TIMEOUT_S = 10.0
MAX_UNAUTHENTICATED = 64
MAX_HELLO_BYTES = 4096
PROTOCOL_VERSION = 2


class HelloRefused(Exception):
    """A connection that did not prove who it is: dropped without reading anything else it sends."""


class ChannelRefused(ConnectionError):
    """The driver did not accept this connection's hello."""


def read_line(sock: socket.socket, deadline: float, limit: int = MAX_HELLO_BYTES) -> bytes:
    """One ``\\n``-terminated line, read byte-economically before ``deadline`` (monotonic) passes.

    A client trickling a byte every few seconds gets no fresh timeout per byte: the deadline is
    for the whole line.
    """
    data = bytearray()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise HelloRefused("the hello took too long")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(512, limit + 1 - len(data)), socket.MSG_PEEK)
        except TimeoutError:
            raise HelloRefused("the hello took too long") from None
        if not chunk:
            raise HelloRefused("the connection closed during the hello")
        # Take only up to the newline, so bytes after the hello stay for the message reader.
        end = chunk.find(b"\n")
        take = len(chunk) if end < 0 else end + 1
        data += sock.recv(take)
        if len(data) > limit:
            raise HelloRefused("the hello is too long")
    return bytes(data)


def read_json(sock: socket.socket, deadline: float) -> dict[str, Any]:
    try:
        msg = json.loads(read_line(sock, deadline))
    except ValueError:
        raise HelloRefused("the hello is not JSON") from None
    if not isinstance(msg, dict):
        raise HelloRefused("the hello is not a JSON object")
    return msg


def send_json(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def rank_proof(node_key: bytes, nonce: str, hello: dict[str, Any]) -> str:
    """The rank's answer to the driver's challenge: HMAC(node key, nonce and the hello's claims)."""
    claims = [nonce, hello.get("node"), hello.get("rank"), hello.get("generation"), hello.get("host")]
    return hmac.new(node_key, json.dumps(claims).encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Node:
    """A node the driver verified: where it runs, its key, and which registration it is."""

    node: int
    #: The host Spark's scheduler runs the node on: connections must come from there.
    host: str
    key: bytes
    #: Counts registrations of this node (one per Spark task attempt): part of the generation.
    attempt: int
    #: How the log names the host: the node's own name for it when that is the same host
    #: (``127.0.0.1`` for the scheduler's ``localhost``), else the scheduler's.
    shown: str = ""


#: ``verify(node, task_attempt_id, peer_ip) -> host``: the host Spark's scheduler runs that task
#: attempt of that partition on, when ``peer_ip`` is that host; raises :class:`HelloRefused` otherwise.
NodeVerifier = Callable[[int, int, str], str]


class NodeRegistry:
    """The driver's record of verified nodes; socket-free, so tests drive it directly.

    Example::

        registry = NodeRegistry(ranks_of_node=lambda n: range(2 * n, 2 * n + 2), verify=verifier)
        node = registry.register(0, task_attempt=17, peer_ip="10.0.0.1")   # the node's key in node.key
        registry.check_rank({"node": 0, "rank": 1, ...}, nonce, proof, peer_ip="10.0.0.1")
    """

    def __init__(self, ranks_of_node: Callable[[int], range], verify: NodeVerifier | None) -> None:
        self._ranks_of_node = ranks_of_node
        self._verify = verify
        self._lock = threading.Lock()
        self._nodes: dict[int, Node] = {}
        self._task_attempts: set[int] = set()
        #: ``claim_secret(node)``: each node must prove it holds its own (None: the scheduler vouches).
        self.claim_secret: Callable[[int], bytes] | None = None
        #: An elastic run's key for its rendezvous state, handed to each node it verifies.
        self.elastic_key: bytes | None = None

    def check_claim(self, hello: dict[str, Any], nonce: str, proof: Any) -> bytes:
        """A node's answer to its claim challenge; returns its claim secret once the proof verifies."""
        node = hello.get("node")
        if self.claim_secret is None or type(node) is not int:
            raise HelloRefused(f"bad node claim (node={node!r})")
        secret = self.claim_secret(node)  # raises HelloRefused for a node outside the run
        if not isinstance(proof, str) or not hmac.compare_digest(proof, claim_proof(secret, nonce, hello)):
            raise HelloRefused(
                f"node {node}'s claim did not prove it holds that node's own claim secret (the run's "
                "token, which every task of the job holds, is not enough)"
            )
        return secret

    def add_local(self, node: int, host: str) -> Node:
        """A node the driver runs itself (local mode): its key is made here, no registration."""
        with self._lock:
            previous = self._nodes.get(node)
            entry = Node(node, host, secrets.token_bytes(32), previous.attempt + 1 if previous else 0, host)
            self._nodes[node] = entry
            return entry

    def register(self, node: Any, task_attempt: Any, peer_ip: str, claimed_host: Any = None) -> Node:
        """A barrier task's agent asks for its node key; Spark's scheduler must vouch for it."""
        if type(node) is not int or type(task_attempt) is not int or node < 0 or task_attempt < 0:
            raise HelloRefused(f"bad node registration (node={node!r}, task attempt={task_attempt!r})")
        if self._verify is None:
            raise HelloRefused("this run has no barrier tasks to register")
        host = self._verify(node, task_attempt, peer_ip)
        with self._lock:
            if task_attempt in self._task_attempts:
                raise HelloRefused(f"task attempt {task_attempt} already registered")
            self._task_attempts.add(task_attempt)
            previous = self._nodes.get(node)
            shown = claimed_host if same_host(claimed_host, host) else host
            entry = Node(node, host, secrets.token_bytes(32), previous.attempt + 1 if previous else 0, shown)
            self._nodes[node] = entry
            return entry

    def check_rank(self, hello: dict[str, Any], nonce: str, proof: Any, peer_ip: str) -> Node:
        """The node a rank's connection belongs to, once its proof and claims check out."""
        node_id, rank = hello.get("node"), hello.get("rank")
        if type(node_id) is not int or type(rank) is not int or not isinstance(hello.get("generation"), int):
            raise HelloRefused("bad rank hello")
        with self._lock:
            node = self._nodes.get(node_id)
        if node is None:
            raise HelloRefused(f"node {node_id} is not registered")
        expected = rank_proof(node.key, nonce, hello)
        if not isinstance(proof, str) or not hmac.compare_digest(proof, expected):
            raise HelloRefused(f"rank {rank} did not prove it holds node {node_id}'s key")
        if rank not in self._ranks_of_node(node_id):
            raise HelloRefused(f"rank {rank} does not belong to node {node_id}")
        if not peer_matches(peer_ip, node.host):
            raise HelloRefused(f"rank {rank} of node {node_id} connected from {peer_ip}, not {node.host}")
        return node

    def current(self, node: int) -> Node | None:
        """The node's latest registration (an earlier one's connection may still close late)."""
        with self._lock:
            return self._nodes.get(node)

    def host_of(self, node: int) -> str | None:
        """The node's host as the log shows it, None when it is not registered."""
        with self._lock:
            entry = self._nodes.get(node)
        return entry.shown if entry else None


@dataclass(frozen=True)
class Peer:
    """Who a connection proved to be: a node's agent, a rank, or an owner."""

    role: str
    #: The verified node of an agent or a rank (None for an owner).
    node: Node | None = None
    rank: int | None = None
    #: A rank's worker-group generation (torchrun's restart count).
    generation: int = 0


def authenticate(
    conn: socket.socket, deadline: float, *, token: bytes, owner_token: bytes | None, registry: NodeRegistry
) -> Peer:
    """The driver's side of the hello: who this connection is, all before ``deadline`` (monotonic).

    Raises :class:`HelloRefused` for anything that does not prove who it is. A wrong token (run or
    owner) gets no answer; after the token check, a refusal is answered with its reason, for the log.
    """
    hello = read_json(conn, deadline)
    if hello.get("role") == "owner":
        given = str(hello.get("owner_token", "")).encode()
        if owner_token is None or not hmac.compare_digest(given, owner_token):
            raise HelloRefused("wrong owner token")
        send_json(conn, {"ok": True})
        return Peer("owner")
    if not hmac.compare_digest(str(hello.get("token", "")).encode(), token):
        raise HelloRefused("wrong token")
    peer_ip = conn.getpeername()[0]
    try:
        if hello.get("role") == "node":
            return Peer("node", _register_node(conn, deadline, hello, registry, peer_ip))
        if hello.get("role") != "rank":
            raise HelloRefused(f"unknown role {hello.get('role')!r}")
        nonce = secrets.token_hex(16)
        send_json(conn, {"nonce": nonce})
        answer = read_json(conn, deadline)
        node = registry.check_rank(hello, nonce, answer.get("proof"), peer_ip)
        send_json(conn, {"ok": True})
        return Peer("rank", node, hello["rank"], hello["generation"])
    except HelloRefused as exc:
        with contextlib.suppress(OSError):
            send_json(conn, {"error": str(exc)})
        raise


def _register_node(
    conn: socket.socket, deadline: float, hello: dict[str, Any], registry: NodeRegistry, peer_ip: str
) -> Node:
    """A node's claim: first its challenge, where it must prove its own claim secret; then its
    keys (wrapped under that secret, where there is one) and its host."""
    secret, nonce = None, ""
    if registry.claim_secret is not None:
        nonce = secrets.token_hex(16)
        send_json(conn, {"nonce": nonce})
        secret = registry.check_claim(hello, nonce, read_json(conn, deadline).get("proof"))
    node = registry.register(hello.get("node"), hello.get("task"), peer_ip, hello.get("host"))
    keys = {"key": node.key}
    if registry.elastic_key is not None:
        keys["elastic_key"] = registry.elastic_key
    # The host too: an ordinary (elastic) task does not know its own as Spark names it.
    reply: dict[str, Any] = {"host": node.host}
    for label, key in keys.items():
        reply[label] = (key if secret is None else wrap_key(secret, nonce, label, key)).hex()
    send_json(conn, reply)
    return node


class HelloGate:
    """Caps how many connections may be in their hello at once; the rest are dropped at once."""

    def __init__(self, limit: int = MAX_UNAUTHENTICATED) -> None:
        self._slots = threading.BoundedSemaphore(limit)

    def enter(self) -> bool:
        return self._slots.acquire(blocking=False)

    def leave(self) -> None:
        self._slots.release()
