"""Elastic runs (``num_processes="MIN:MAX"``): the driver's rendezvous store, and the Spark task.

A barrier stage is all-or-nothing: it cannot start with MIN of MAX tasks, and losing one task
cancels all of them. An elastic run is therefore an ordinary stage of MAX/nproc_per_node tasks,
each running one torchrun agent with ``--nnodes=MIN:MAX`` and torch's ``c10d`` rendezvous, whose
store the driver hosts (not task 0, which may be the one lost). Spark's task retry is what brings a
lost node back when a slot frees up; a task that arrives after the run finished finds the
rendezvous closed and ends at once.

When Spark loses an executor, the ranks on the other hosts may block in a collective until gloo's
timeout (30 minutes). So the driver forces the restart: it writes a signed request naming the
loss into its store (:meth:`RendezvousStore.restart_survivors`), and every agent's
:class:`RestartWatch` stops its workers that were started before the loss. Their agents then restart them, which
re-rendezvouses at the new size; the ranks resume from ``load_latest_checkpoint``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from airflow_provider_torchdist.spark.elastic.workers import stop_workers_started_before
from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import NodeLeft, NodeStarted

#: The store key of the driver's restart request (outside torch's ``torch.rendezvous.`` keys).
RESTART_KEY = "torchdist/restart"
#: How often an agent looks at the counter.
WATCH_EVERY_S = 0.2


class RendezvousStore:
    """The ``c10d`` rendezvous store of an elastic run, served by the driver on ``host`` only.

    Torch's own backends listen on every interface; this one takes a socket bound to the address
    the executors reach the driver at (``master_listen_fd``, as ``spark/rendezvous.py`` does).
    ``key``: the run's random **elastic key**, which signs its state and restart requests (keys
    derived from it, never from the run's token); the channel hands it to each verified node.
    """

    def __init__(self, host: str, timeout: float) -> None:
        import secrets

        from torch.distributed import TCPStore

        from airflow_provider_torchdist.spark.node.network import listen_on
        from airflow_provider_torchdist.spark.node.signed_rendezvous import run_key

        self.key = secrets.token_bytes(32)
        self._key = run_key(self.key, "restart")
        self._restarts = 0
        self._lock = threading.Lock()  # losses are reported from several threads at once

        listener = listen_on(host, 0)
        port = listener.getsockname()[1]
        # TCPStore owns the descriptor from the call on and closes it, even when it fails.
        self._store = TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=listener.detach(),
        )
        self.address = (host, port)

    def restart_survivors(self, lost_at: float, leave: list[int] | None = None) -> int:
        """Tell every agent to restart its workers that started before ``lost_at`` (epoch seconds;
        0: none), and the nodes in ``leave`` to leave the run; returns the count of such requests.
        Signed: the store has no authentication."""
        from airflow_provider_torchdist.spark.node.signed_rendezvous import seal

        with self._lock:
            self._restarts += 1
            request = json.dumps({"n": self._restarts, "before": lost_at, "leave": leave}).encode()
            self._store.set(RESTART_KEY, seal(self._key, request))
            return self._restarts

    def leave(self, nodes: list[int]) -> int:
        """Tell ``nodes`` (node ranks) to leave the run, their ranks killed (a hung node:
        :mod:`.hung_nodes`); the other agents restart nothing for it."""
        return self.restart_survivors(0.0, leave=nodes)


class RestartWatch:
    """An agent's watch on the driver's restart requests: a new one stops this node's workers that
    started before the loss it names.

    A worker group that re-formed after the loss (its ranks saw their peers' sockets close) is left
    alone. The request is signed with a key from the run's elastic key (``elastic_key``, from the
    driver); one that does not verify is ignored, so a stranger who reaches the store cannot make
    the run spend its restarts. A request that names this ``node`` among those to leave makes
    it leave (:func:`.workers.leave_the_run`), and :attr:`left` turns True.
    """

    def __init__(
        self, store: tuple[str, int], timeout: float, elastic_key: bytes, node: int | None = None
    ) -> None:
        from torch.distributed import TCPStore

        from airflow_provider_torchdist.spark.node.signed_rendezvous import run_key

        self._key = run_key(elastic_key, "restart")
        self._client = TCPStore(
            store[0], store[1], is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        self._seen, self._node, self.left = 0, node, False
        self._seen = self._request()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchdist-restart-watch", daemon=True)
        #: How many times this node's workers were stopped for a restart.
        self.restarts = 0

    def __enter__(self) -> RestartWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _request(self) -> tuple[int, float, list[int]]:
        """The latest verified request: ``(its number, the loss time, the nodes to leave)``;
        ``(0, 0.0, [])`` for none."""
        from airflow_provider_torchdist.spark.node.signed_rendezvous import unseal

        if not self._client.check([RESTART_KEY]):
            return 0, 0.0, []
        try:
            request = json.loads(unseal(self._key, self._client.get(RESTART_KEY), "restart request"))
            return int(request["n"]), float(request["before"]), list(request.get("leave") or [])
        except Exception:  # unsigned, forged or malformed: not the driver's
            return self._seen, 0.0, []

    def _run(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            try:
                number, lost_at, leave = self._request()
            except Exception:  # the driver is gone: the run is ending, Spark ends this task
                return
            if number > self._seen and self._node is not None and self._node in leave:
                from airflow_provider_torchdist.spark.elastic.workers import leave_the_run

                self.left = True  # before the agent's signal: the task reads it once the agent ends
                leave_the_run()
                return
            if number > self._seen:
                self._seen = number
                if lost_at:
                    self.restarts += 1
                    stop_workers_started_before(lost_at)


def elastic_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    store: tuple[str, int],
    driver_output_dir: str | None,
    _: Iterator[Any],
    *,
    entry_path: str | None = None,
    on_driver_lost: Callable[[], None] | None = None,
    claim_secret: bytes | None = None,
) -> Iterator[str]:
    """One node of an elastic run: register with the driver, then run torchrun's agent for MIN:MAX.

    The node rank is the Spark partition id; the global ranks are the rendezvous's to give, per
    generation. Failures go to the driver over the run channel, as in a barrier task. ``entry_path``:
    the payload's path on this executor (default: shipped with the application, ``SparkFiles``);
    ``on_driver_lost``: called if the driver's end of the channel closes while the node runs (over
    Spark Connect, the server's job would go on without its driver); ``claim_secret``: over Spark
    Connect, where no scheduler vouches for the node, its own credential for its claim.
    """
    from pyspark import TaskContext

    from airflow_provider_torchdist.spark.node.rank import die_with_parent

    die_with_parent()
    ctx = TaskContext.get()
    node = ctx.partitionId()
    emit("task_start", node=node)
    # An ordinary task has no list of its peers' addresses: the driver tells the node its host, as
    # Spark's scheduler placed it, when it vouches for it.
    attempt = ctx.taskAttemptId()
    client = ChannelClient.as_node(
        channel_address, spec.token, node=node, task_attempt=attempt, host=None, claim_secret=claim_secret
    )
    if client.host is None or client.elastic_key is None:
        raise RuntimeError("the driver did not tell this node its host and elastic key: other versions")
    host = client.host
    client.send(NodeStarted())
    failures: list[RankFailure]
    stop_watching = client.watch_driver(on_driver_lost) if on_driver_lost else (lambda: None)
    try:
        failures = run_elastic_node(ctx, client, spec, channel_address, store, driver_output_dir, entry_path)
    except Exception as exc:
        failures = [RankFailure(rank=None, host=host, exc_type=type(exc).__name__, message=str(exc))]
    finally:
        stop_watching()
    stopped = [f for f in failures if f.exc_type == "SignalException"]
    if stopped:
        # Spark stopped this node (its executor went away, or the stage was cancelled): in an
        # elastic run that is a lost node, which the others survive while MIN remain, not a failure.
        client.line("err", f"this node was stopped and leaves the run ({stopped[0].message})")
        client.send(NodeLeft())  # the driver may not see it otherwise (over Spark Connect)
        failures = []
    if failures:
        client.failures(failures)
    client.close()
    emit("task_end", node=node)
    yield json.dumps({"node": node, "host": host, "failed": bool(failures)})


def run_elastic_node(
    ctx: Any,
    client: ChannelClient,
    spec: JobSpec,
    channel_address: tuple[str, int],
    store: tuple[str, int],
    driver_output_dir: str | None,
    entry_path: str | None = None,
) -> list[RankFailure]:
    """This node's agent for MIN:MAX on the driver's store, its GPUs set, under a
    :class:`RestartWatch`; returns the failures of its ranks."""
    from pyspark import SparkFiles

    from airflow_provider_torchdist.spark.elastic.hung_nodes import left_hung
    from airflow_provider_torchdist.spark.node.barrier import gpu_environment, shared_output_dir

    gpus = ctx.resources().get("gpu")
    os.environ.update(gpu_environment(spec, list(gpus.addresses) if gpus else None))
    from airflow_provider_torchdist.spark.node.launcher import launch_node  # imports torch
    from airflow_provider_torchdist.spark.node.signed_rendezvous import use_key

    assert client.host is not None and client.elastic_key is not None
    use_key(spec.run_id, client.elastic_key)  # the agent's rendezvous signs its state with it
    with RestartWatch(store, spec.rendezvous_timeout, client.elastic_key, node=ctx.partitionId()) as watch:
        failures = launch_node(
            spec,
            node_rank=ctx.partitionId(),
            entry_path=entry_path or SparkFiles.get(spec.entry),
            channel_address=channel_address,
            host=client.host,
            task_cpus=ctx.cpus(),
            # Any node may hold rank 0 in some generation.
            output_dir=shared_output_dir(driver_output_dir),
            node_key=client.node_key,
            store=store,
        )
    return [left_hung(client.host)] if watch.left else failures
