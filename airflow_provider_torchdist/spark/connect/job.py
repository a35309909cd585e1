"""What the Connect driver checks and watches of its job: the nodes that connect to its channel
(:class:`ConnectVerifier`), the slots the job waits for (:class:`SlotWatch`), the payload's size
against the server's message limit, and the job's operation, told to the owner once
(:class:`OperationAnnouncer`)."""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.owner import write_channel_address
from airflow_provider_torchdist.spark.driver.slots import SlotsUnavailable
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused
from airflow_provider_torchdist.spark.wire.connect_ids import connect_operation
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.node_claims import claim_secret

#: What a Connect server takes in one gRPC message by default (``spark.connect.grpc.maxInboundMessageSize``).
DEFAULT_MAX_MESSAGE = 128 * 1024 * 1024
#: Room in the job's plan for what is not the payload (the pickled task function, the spec).
PLAN_ROOM = 1024 * 1024


class ConnectVerifier:
    """Accepts each of the run's ``nodes`` once, on the host it connects from (the run's token
    proved in the hello). A second claim of a node is refused and stops the run: Spark retried a
    task of the barrier stage (which cannot go on without it), or someone else holds the token.

    ``retries``: an elastic run's lost node comes back when Spark retries its task, as a new task
    attempt on any host. A node may then be claimed again, only once its previous agent is gone
    (:meth:`release`), and the run takes nodes back at most ``retries`` times **in all**, whichever
    nodes they are: a claim, a leave and a claim again cannot spend more than that. Over Connect the
    task attempt is the node's own word, not the scheduler's; an elastic run's channel therefore
    also has each node prove its own :meth:`claim_secret` (``NodeRegistry.claim_secret``), which
    only that node's task receives, so the token alone claims nothing."""

    def __init__(self, nodes: int, on_conflict: Any = None, retries: int = 0) -> None:
        self._count = nodes
        self._on_conflict = on_conflict
        self._retries = retries
        self._lock = threading.Lock()
        self._nodes: dict[int, str] = {}
        self._released: set[int] = set()
        #: How many times the run took a node back, all nodes together.
        self.comebacks = 0
        # Only this process (the run's driver) holds it; each node's secret is derived from it.
        self._run_secret = secrets.token_bytes(32)

    def claim_secret(self, node: int) -> bytes:
        """Node ``node``'s own claim secret, for its task's input row alone."""
        if type(node) is not int or not 0 <= node < self._count:
            raise HelloRefused(f"node {node!r} is not one of this run's {self._count} node(s)")
        return claim_secret(self._run_secret, node)

    def release(self, node: int) -> None:
        """Node ``node``'s agent left the run (its process died, or Spark stopped it): a retry of
        its task may claim it again."""
        with self._lock:
            if node in self._nodes:
                self._released.add(node)

    def __call__(self, node: int, task_attempt: int, peer_ip: str) -> str:
        if not 0 <= node < self._count:
            raise HelloRefused(f"node {node} is not one of this run's {self._count} node(s)")
        with self._lock:
            first = self._nodes.get(node)
            again = first is not None and node in self._released and self.comebacks < self._retries
            if first is None or again:
                self._nodes[node] = peer_ip
                self._released.discard(node)
                self.comebacks += 1 if again else 0
                conflict = None
            elif self._retries:
                conflict = (
                    f"node {node} claimed again (task attempt {task_attempt} from {peer_ip}) while its agent "
                    f"from {first} is still in the run, or past the run's {self._retries} comeback(s) in "
                    f"all ({self.comebacks} taken): refused; Spark retried the task of a host that froze, "
                    "or that node's task claims, leaves and claims again"
                )
            else:
                conflict = (
                    f"node {node} registered a second time (task attempt {task_attempt} from {peer_ip}; first "
                    f"from {first}): Spark retried a barrier task, or someone else holds the run's token"
                )
        if conflict is not None:
            if self._on_conflict is not None:
                self._on_conflict(conflict)
            raise HelloRefused(conflict)
        return peer_ip


def local_slots(master: str, task_cpus: int) -> int | None:
    """The task slots of a ``local[N]`` server master (None: a cluster, or ``local[*]``)."""
    match = re.fullmatch(r"local\[(\d+)(,\d+)?\]|local", master.strip())
    if match is None:
        return None
    return int(match[1] or 1) // max(task_cpus, 1)


class SlotWatch:
    """Fails the run when not every barrier task (an elastic run: not ``needed``, its MIN nodes)
    has started within ``timeout`` seconds.

    A Connect client cannot see the cluster's executors; what it can see is whether the job's
    tasks reported in. A barrier stage starts all its tasks at once or none, so none by then means
    the cluster cannot fit the stage now (Spark's own check would wait about 10 minutes).

    With ``after_shuffle`` (a run with ``train_data``), the job's first stages compute and shuffle
    the rows, however long that takes: the clock starts once the server's progress reports
    (:meth:`progress`, a Connect progress handler) show every stage but the last done.
    """

    def __init__(
        self,
        channel: RunChannel,
        needed: int,
        timeout: float | None,
        cancel: Any,
        after_shuffle: bool = False,
        elastic: bool = False,
    ) -> None:
        self._channel, self._needed, self._timeout, self._cancel = channel, needed, timeout, cancel
        #: An elastic run's tasks start one by one, and ``needed`` of them (its MIN) are enough.
        self._elastic = elastic
        self._done = threading.Event()
        self._clock = threading.Event()
        #: Stages any report showed done: a later job lists a stage it reuses as not done (skipped).
        self._stages_done: set[int] = set()
        if not after_shuffle:
            self._clock.set()
        #: Set when the watch gave up: the run's error.
        self.error: str | None = None

    def progress(self, *, stages: Any = None, **_: Any) -> None:
        """A Connect progress report: the barrier stage (the job's last) is the only one not done."""
        stages = list(stages or ())
        self._stages_done.update(stage.stage_id for stage in stages if stage.done)
        if len(stages) >= 2 and not self._clock.is_set():
            # Adaptive execution runs the shuffle as a job of its own; the barrier job that follows
            # lists the shuffle's stage again, never to run (skipped), so never reported done there.
            last = max(stage.stage_id for stage in stages)
            if all(stage.stage_id in self._stages_done for stage in stages if stage.stage_id != last):
                self._clock.set()

    def __enter__(self) -> SlotWatch:
        threading.Thread(target=self._watch, daemon=True, name="torchdist-slot-watch").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._clock.wait(1.0):  # the rows are still being dealt to the nodes
            if self._done.is_set():
                return
        start = time.monotonic()
        next_say = start + 10
        while not self._done.wait(1.0):
            started = len(self._channel.started_nodes)
            if started >= self._needed:
                return
            waited = time.monotonic() - start
            if self._timeout is not None and waited >= self._timeout:
                needs = (
                    f"The elastic run needs {self._needed} task slot(s) (its MIN)"
                    if self._elastic
                    else f"The barrier stage needs {self._needed} task slot(s) at once"
                )
                self.error = (
                    f"{needs}, and {started} of its tasks started within slot_timeout={self._timeout:.0f}s over Spark Connect: the cluster is too "
                    "small or busy, or its executors cannot reach the run channel on "
                    f"{self._channel.address[0]}:{self._channel.address[1]} (the connection's extra channel-host "
                    "sets it). Lower num_processes, raise nproc_per_node, or give the cluster more executors/cores."
                )
                self._cancel()
                return
            if time.monotonic() >= next_say:
                next_say += 10
                why = (
                    "the run needs MIN ranks' tasks"
                    if self._elastic
                    else "the stage needs all its task slots at once"
                )
                kind = "task(s)" if self._elastic else "barrier task(s)"
                self._channel.say(
                    f"waiting for {self._needed - started} of {self._needed} {kind} to start: {why}"
                )


@contextlib.contextmanager
def followed(spark: Any, channel: RunChannel, watch: SlotWatch) -> Iterator[None]:
    """While the job runs: the server's progress reports go to ``watch`` (are its tasks starting?)
    and to an :class:`OperationAnnouncer` (the application and operation, for the run's owners)."""
    announce = OperationAnnouncer(channel, server_setting(spark, "spark.app.id", None), spark.session_id)
    spark.registerProgressHandler(watch.progress)
    spark.registerProgressHandler(announce.progress)
    try:
        with watch:
            yield
    finally:
        spark.removeProgressHandler(announce.progress)
        spark.removeProgressHandler(watch.progress)
        announce.last_call()


def open_connect_run(channel: RunChannel, staging: Path, mode: str) -> None:
    """The run's first lines: where its channel listens (in the staging directory, for the
    owners; in the log, for whoever must open the way from the executors), and whose lines show."""
    write_channel_address(staging, channel.address)
    host, port = channel.address
    channel.say(f"{mode}, run channel on {host}:{port} (the executors must reach it)")
    if channel.rank_filter:
        channel.say(channel.rank_filter.announcement())


def server_setting(spark: Any, key: str, default: str | None) -> str | None:
    """One of the server's settings, or ``default`` when the server hides it."""
    with contextlib.suppress(Exception):
        return spark.conf.get(key, default)
    return default


def job_payload(
    spark: Any, spec: JobSpec, staging: Path, py_files: list[str]
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """What the job carries to its tasks: the entry (none in module mode) and the user's
    ``py_files`` as ``(name, bytes)``; first, a ``local[N]`` server that cannot fit the job's tasks
    at once (an elastic run: its MIN's) is refused, and so is a payload the server's messages cannot
    carry."""
    needed = spec.min_nodes if spec.elastic else spec.num_nodes
    master = server_setting(spark, "spark.master", "") or ""
    task_cpus = server_setting(spark, "spark.task.cpus", "1") or "1"
    slots = local_slots(master, int(task_cpus))  # a server that hides its master: no local check
    if slots is not None and slots < needed:
        raise SlotsUnavailable(needed, slots, f"the Connect server's master {master}", elastic=spec.elastic)
    entry = b"" if spec.kind == "module" else (staging / spec.entry).read_bytes()
    shipped = [(Path(p).name, Path(p).read_bytes()) for p in py_files]
    check_payload_size(len(entry) + sum(len(data) for _, data in shipped), spark)
    return entry, shipped


def check_payload_size(size: int, spark: Any) -> None:
    """Refuse, before the job goes, a payload the server would refuse as a gRPC message too large.

    The payload travels inside the job's plan (never as a file on a shared path), and the server
    takes a plan of at most ``spark.connect.grpc.maxInboundMessageSize`` bytes."""
    limit = DEFAULT_MAX_MESSAGE
    with contextlib.suppress(Exception):  # a server that hides its settings: the default
        limit = int(spark.conf.get("spark.connect.grpc.maxInboundMessageSize", str(DEFAULT_MAX_MESSAGE)))
    if size + PLAN_ROOM > limit:
        raise ValueError(
            "the training payload (the pickled callable with its args and kwargs, or the script, and "
            f"py_files) is {size / 2**20:.1f} MiB, and a Spark Connect job carries it in its plan, which this server takes "
            f"up to {limit / 2**20:.0f} MiB (spark.connect.grpc.maxInboundMessageSize). Pass large data by "
            "path instead (a file or train_data the executors read), or raise that setting on the server."
        )


class OperationAnnouncer:
    """Tells the run's owners its application and, once Spark Connect names it (its first progress
    report, about 2 s into the job), its operation: ``<session id>/<operation id>``, for the run's
    record. Registered with ``SparkSession.registerProgressHandler``."""

    def __init__(self, channel: RunChannel, app_id: str | None, session_id: str) -> None:
        self._channel, self._app_id, self._session_id = channel, app_id, session_id
        self._lock = threading.Lock()
        self._said = False

    def progress(self, *, operation_id: str | None = None, **_: Any) -> None:
        if operation_id:
            self._say(connect_operation(self._session_id, operation_id))

    def last_call(self) -> None:
        """The job has ended: the application, if no progress report named the operation."""
        self._say(None)

    def _say(self, operation: str | None) -> None:
        with self._lock:
            if self._said or self._app_id is None:
                return
            self._said = True
        self._channel.application(self._app_id, None, operation)
