"""The run channel: how ranks and agents on any host talk back to the driver, and the hook listens.

One TCP server per run, on the driver. Every connection opens with a hello that proves who it is
(:mod:`~airflow_provider_torchdist.spark.wire.channel_auth`): a node's agent is vouched for by Spark's
scheduler and gets its node key; a rank answers a challenge with that key; an owner (the hook)
presents the owner token. A connection that does not prove itself within one deadline is dropped
before anything else it sends is read. After the hello, a rank or agent sends the messages of
:mod:`~airflow_provider_torchdist.spark.wire.protocol`, each only from the role that may send it
(:meth:`RunChannel._handle`); what they report goes into the socket-free
:class:`~airflow_provider_torchdist.spark.driver.ledger.RunLedger`. An owner sends nothing more: it
receives the log lines the driver prints, the application and metrics (:mod:`.owner`). The
driver sends a rank one thing: a stop request, when the run is stopped (:mod:`.stop_fanout`).
The ranks' and agents' end is :mod:`~airflow_provider_torchdist.spark.node.channel_client`.
"""

# size: the run channel's server, one class whose handlers share its state under one lock: about
# 300 lines, kept whole.

from __future__ import annotations

import dataclasses
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_torchdist.spark.driver.hang_detection import HangDetector
from airflow_provider_torchdist.spark.driver.ledger import RunLedger
from airflow_provider_torchdist.spark.driver.output_receipt import receive_output
from airflow_provider_torchdist.spark.driver.owner import OwnerHub
from airflow_provider_torchdist.spark.driver.rank_logs import RankLogFilter
from airflow_provider_torchdist.spark.driver.stop_fanout import StopFanout
from airflow_provider_torchdist.spark.driver.stragglers import SUMMARY_FIELD
from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.node.metrics import format_metrics
from airflow_provider_torchdist.spark.wire import protocol as wire
from airflow_provider_torchdist.spark.wire.channel_auth import (
    HELLO_TIMEOUT_S,
    ChannelRefused,
    HelloGate,
    HelloRefused,
    Node,
    NodeRegistry,
    NodeVerifier,
    Peer,
    authenticate,
)
from airflow_provider_torchdist.spark.wire.logsafe import escape_controls
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.output_store import OutputLedger

__all__ = ["ChannelClient", "ChannelRefused", "RunChannel"]


@dataclass
class _Connection:
    """A verified rank's or agent's connection, as the driver serves it."""

    peer: Peer
    sock: socket.socket
    rfile: BinaryIO
    host: str | None
    prefix: str
    #: The stage attempt of an agent's barrier task, from its ``NodeStarted``.
    generation: int = 0
    #: Elastic runs: the worker-group generation that rank 0's ``WorldSize`` opened on this connection.
    elastic_generation: int | None = None


class RunChannel:
    """The driver's end: accepts this run's ranks, prints their lines, keeps errors and the output.

    ``echo_stdout``: also print every log line to the driver's stdout (spark-submit's output), as
    well as sending it to owners: when no owner follows the run (no owner token).

    Example::

        with RunChannel(token, "127.0.0.1", staging_dir, ranks_of_node=lambda n: range(2)) as channel:
            ...  # ranks connect to channel.address
        channel.failures  # what ranks and agents reported
    """

    def __init__(
        self,
        token: str,
        bind_host: str,
        output_dir: str | Path,
        on_failure: Callable[[], None] | None = None,
        out: Any = None,
        *,
        ranks_of_node: Callable[[int], range],
        verify_node: NodeVerifier | None = None,
        hello_timeout: float = HELLO_TIMEOUT_S,
        owner_token: str | None = None,
        echo_stdout: bool = True,
        rank_filter: RankLogFilter | None = None,
        on_world_size: Callable[[int], int] | None = None,
        on_node_gone: Callable[[Node], None] | None = None,
    ) -> None:
        self._token = token.encode()
        self._owner_token = owner_token.encode() if owner_token else None
        self._output_dir = Path(output_dir)
        #: Verified nodes and their keys; ``verify_node`` asks Spark's scheduler (None: no barrier tasks).
        self.registry = NodeRegistry(ranks_of_node, verify_node)
        #: What ranks and agents reported: nodes, errors, failures, metrics, endpoints.
        self.ledger = RunLedger()
        self.outputs = OutputLedger(self._output_dir)
        self.owners = OwnerHub()
        self.hello_timeout, self.echo_stdout = hello_timeout, echo_stdout
        #: ``log_ranks``: whose lines are shown (None: everyone's).
        self.rank_filter = rank_filter
        self._gate = HelloGate()
        #: Connections refused in their hello, and why (for tests and the log).
        self.rejected = 0
        self.refusals: list[str] = []
        self._refusals_lock = threading.Lock()
        # Elastic runs: rank 0's ``WorldSize`` numbers the new generation; a node whose agent left
        # (``NodeLeft``) or whose connection closed without a goodbye (its process died) is gone.
        self._on_failure, self._on_world_size, self._on_node_gone = on_failure, on_world_size, on_node_gone
        self._out = out or sys.stdout
        self._print_lock = threading.Lock()
        #: A graceful stop (``stop-request.json``); each rank's progress, for :mod:`.hang_watch`.
        self.stops, self.hangs = StopFanout(self._output_dir, self.say), HangDetector()
        channel = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                channel._serve(self.connection, self.rfile)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            # Every rank connects at the start at once: socketserver's backlog of 5 would leave
            # the rest retransmitting their SYN for seconds.
            request_queue_size = 1024

        self._server = _Server((bind_host, 0), _Handler)
        # serve_forever polls for shutdown; its 0.5 s default would be a 0.25 s wait on average at
        # close, at the end of every run.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), name="torchdist-channel", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def __enter__(self) -> RunChannel:
        self._thread.start()
        self.stops.watch()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving; owners get what is queued for them, then their stream ends."""
        self.stops.close()
        self.ledger.close()
        self._server.shutdown()
        self._server.server_close()
        self.owners.close()
        if self.rank_filter:
            self.rank_filter.close()

    # The ledger's facts, for the driver.
    @property
    def failures(self) -> list[RankFailure]:
        return self.ledger.failures

    @property
    def agent_failures(self) -> list[RankFailure]:
        return self.ledger.agent_failures

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return self.ledger.metrics

    @property
    def started_nodes(self) -> set[int]:
        return self.ledger.started_nodes

    @property
    def node_hosts(self) -> dict[int, str | None]:
        return self.ledger.node_hosts

    def publish_metric(self, record: dict[str, Any]) -> None:
        """Add ``record`` to the run's metrics: kept, sent to the owners, shown in the task log."""
        self.ledger.metric(record)
        self.owners.publish(wire.Metric(record))
        self._log(f"[metrics] {format_metrics(record)}")

    def say(self, text: str) -> None:
        """A line of the driver's own in the task log: ``[torchdist] text``."""
        self._log(f"[torchdist] {text}")

    def application(self, app_id: str, ui_url: str | None, operation: str | None = None) -> None:
        """The Spark application and its UI (and over Spark Connect, the run's operation): the
        application line (always printed), and an owner event."""
        line = f"[torchdist] application {app_id} spark-ui {ui_url or '-'}"
        line = escape_controls(f"{line} connect-operation {operation}" if operation else line)
        self.owners.publish(wire.Application(app_id, ui_url, operation))
        self._log(line)

    def agents_failed(self, failures: list[RankFailure], node: int | None = None) -> None:
        """Node ``node``'s agent reports failed ranks (a signal, an exit code, or an exception)."""
        self._show_failed([f.rank for f in failures if f.rank is not None])
        self.ledger.agents_failed(failures, node=node)

    def _show_failed(self, ranks: list[int]) -> None:
        """A failing rank's last lines reach the log, ``log_ranks`` or not."""
        for rank in ranks if self.rank_filter else ():
            for line in self.rank_filter.failed(rank):
                self._log(line)

    def _log(self, line: str) -> None:
        """One line of the task log: to every owner, and to stdout while ``echo_stdout``."""
        line = escape_controls(line)  # one log line, whatever a rank sent
        self.owners.publish(wire.LogLine(line))
        if self.echo_stdout:
            self._print(line)

    def _print(self, line: str) -> None:
        with self._print_lock:
            self._out.write(escape_controls(line) + "\n")
            self._out.flush()

    def _serve(self, conn: socket.socket, rfile: BinaryIO) -> None:
        if not self._gate.enter():  # too many connections still in their hello: drop this one
            self._refused(None)
            return
        try:
            peer = authenticate(
                conn,
                time.monotonic() + self.hello_timeout,
                token=self._token,
                owner_token=self._owner_token,
                registry=self.registry,
            )
        except (HelloRefused, OSError) as exc:
            # Not one of this run's ranks, or not who it claims to be: drop it, read nothing more.
            self._refused(str(exc))
            return
        finally:
            self._gate.leave()
        conn.settimeout(None)
        if peer.role == "owner":
            self.owners.serve(conn)
            return
        assert peer.node is not None
        host = peer.node.shown
        this = _Connection(peer, conn, rfile, host, wire.rank_prefix(peer.rank, host))
        if peer.rank is not None:
            self.stops.rank_connected(conn, peer.rank)
            self.hangs.connected(conn, peer.rank, host, time.monotonic(), node=peer.node.node)
        clean = False
        try:
            for raw in rfile:
                msg = wire.decode(raw)
                if isinstance(msg, wire.Bye):
                    clean = True
                    break
                self._handle(msg, this)
        except (OSError, ValueError) as exc:
            self.say(f"channel from {this.prefix} broke: {exc!r}")
        finally:
            self.stops.rank_gone(conn)
            self.hangs.gone(conn)
        if not clean:
            if peer.rank is not None:
                self.ledger.rank_vanished(peer.rank, host, node=peer.node.node)
            elif self._on_node_gone is not None:
                self._on_node_gone(peer.node)
            self.say(
                f"channel from {this.prefix} closed without a goodbye: the process may have died; "
                "anything it printed after this is only in its executor's log"
            )

    def _output_generation(self, this: _Connection) -> tuple[int, int]:
        """Which generation's output a rank 0 connection carries; a later one replaces an earlier.

        Fixed runs: (the node's registration, torchrun's restart count). Elastic runs: the
        generation the driver numbered from this connection's ``WorldSize``, since rank 0 moves
        between nodes and the nodes' restart counts differ.
        """
        assert this.peer.node is not None
        if self._on_world_size is None:
            return (this.peer.node.attempt, this.peer.generation)
        if this.elastic_generation is None:
            raise wire.ProtocolError("rank 0 of an elastic run sent its output before its world size")
        return (this.elastic_generation, 0)

    def _refused(self, why: str | None) -> None:
        with self._refusals_lock:
            self.rejected += 1
            if why is not None:
                self.refusals.append(why)

    def _handle(self, msg: wire.Message, this: _Connection) -> None:
        """One message from a verified rank or agent; raises ``ValueError`` for one it may not send."""
        rank, node = this.peer.rank, this.peer.node
        assert node is not None
        agent = rank is None
        match msg:
            case wire.Line(text=text):
                line = f"{this.prefix} {text}"
                held = (
                    rank is not None
                    and self.rank_filter
                    and self.rank_filter.hold(rank, escape_controls(line))
                )
                if not held:
                    self._log(line)
            case wire.Metric():
                if SUMMARY_FIELD in msg.record:  # the driver's own records (each rank's step time)
                    raise ValueError(f"a rank may not send a {SUMMARY_FIELD!r} record")
                self.publish_metric(msg.record)
            case wire.RankError() if rank is not None:
                self._show_failed([rank])
                self.ledger.rank_raised(rank, this.host, msg)
            case wire.AgentFailures(failures=failures) if agent:
                # The node's verified host, not what the message says.
                self.agents_failed([dataclasses.replace(f, host=this.host) for f in failures], node.node)
                if self._on_failure:
                    self._on_failure()
            case wire.NodeLeft() if agent:
                if self._on_node_gone is not None:
                    self._on_node_gone(node)
            case wire.NodeStarted() if agent:
                this.generation = self.ledger.node_started(node.node, this.host)
            case wire.MasterEndpoint(host=host, port=port) if agent and node.node == 0:
                self.ledger.master_announced(this.generation, host, port)
            case wire.MasterQuery(timeout=timeout) if agent:
                this.sock.sendall(wire.encode(self.ledger.wait_for_master(this.generation, timeout)))
            case wire.Progress() if rank is not None:
                self.hangs.progress(this.sock, msg, time.monotonic())
            case wire.Stacks() if rank is not None:
                self.hangs.answered(this.sock, msg)
            case wire.StopAnswer(watching=watching) if rank is not None:
                self.stops.answered(rank, watching)
            case wire.WorldSize(world_size=size) if rank == 0 and self._on_world_size:
                if this.elastic_generation is not None:
                    raise wire.ProtocolError("a second 'world_size' message on one connection")
                this.elastic_generation = self._on_world_size(size)
            case wire.Output() | wire.OutputFile() if rank == 0:
                generation = self._output_generation(this)
                receive_output(self.outputs, self._output_dir, msg, generation, this.rfile)
            case wire.Output() | wire.OutputFile():
                raise wire.ProtocolError(f"rank {rank} sent an output; only global rank 0 may")
            case _:
                raise wire.ProtocolError(f"message {msg.KIND!r} is not allowed on this connection")
