"""The training driver over Spark Connect: ``python -m airflow_provider_torchdist.spark.connect.driver
<staging>/spec.json``, with the server's URL in ``TORCHDIST_CONNECT_URL``.

The spark-submit path starts a Spark driver (a JVM) on this machine; here the Spark driver is the
Connect server's, and this process is only a Connect client (``pyspark-client`` suffices, no Java).
It runs the same barrier stage as :func:`.driver.run_distributed`, as a
``mapInArrow(..., barrier=True)`` job tagged ``torchdist-<run id>``, whose tasks each run one
torchrun agent; the run channel is hosted here, so every rank reports to this process, and the
outcome goes to ``outcome.json`` beside the spec, as on the other path. The payload (pickled
callable and args, or the script) travels inside the job, never as a file on a shared path.

The channel cannot ask Spark's scheduler which host runs a task (a Connect client has no
``SparkContext``): a node is accepted from the address it connects from, once, after proving the
run's token (:class:`ConnectVerifier`). The spark-submit path binds nodes more tightly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from airflow_provider_torchdist.spark.app import finish, hosts_of, started
from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.driver.owner import read_owner_token, write_channel_address
from airflow_provider_torchdist.spark.driver.rank_logs import rank_filter
from airflow_provider_torchdist.spark.driver.slots import SlotsUnavailable
from airflow_provider_torchdist.spark.driver.spark_context import first_line
from airflow_provider_torchdist.spark.node.network import route_address
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused
from airflow_provider_torchdist.spark.wire.connect_ids import canonical_uuid, connect_operation
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import Outcome
from airflow_provider_torchdist.spark.wire.private_files import write_private_bytes, write_private_text

#: The Connect server's URL (``sc://host:port/;token=...``): in the environment, since it may hold a token.
URL_ENV = "TORCHDIST_CONNECT_URL"
#: The address the run channel listens on for the executors (the connection's ``channel-host``).
CHANNEL_HOST_ENV = "TORCHDIST_CHANNEL_HOST"


def job_tag(run_id: str) -> str:
    """The tag of the run's Connect operation: what ``interruptTag`` stops."""
    return f"torchdist-{run_id}"


class ConnectVerifier:
    """Accepts each of the run's ``nodes`` once, on the host it connects from (the run's token
    proved in the hello). A second claim of a node is refused and stops the run: Spark retried a
    task of the barrier stage (which cannot go on without it), or someone else holds the token."""

    def __init__(self, nodes: int, on_conflict: Any = None) -> None:
        self._count = nodes
        self._on_conflict = on_conflict
        self._lock = threading.Lock()
        self._nodes: dict[int, str] = {}

    def __call__(self, node: int, task_attempt: int, peer_ip: str) -> str:
        if not 0 <= node < self._count:
            raise HelloRefused(f"node {node} is not one of this run's {self._count} node(s)")
        with self._lock:
            first = self._nodes.get(node)
            if first is None:
                self._nodes[node] = peer_ip
                conflict = None
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


def channel_host(url: str, server_driver_host: str | None = None, configured: str | None = None) -> str:
    """Where the run channel listens for the executors: the connection's ``channel-host`` when set;
    else this machine's address on the route to the server's Spark driver (which its executors
    reach, so they likely reach this side of that route too); else on the route to the server."""
    if configured:
        return configured
    server = server_host(url)
    for host in (server_driver_host, server):
        if host:
            with contextlib.suppress(OSError):
                return route_address(host)
    raise RuntimeError(
        f"cannot tell which address of this machine the Connect server's executors reach (no route to "
        f"{server_driver_host or server}): set the connection's extra channel-host"
    )


def server_host(url: str) -> str | None:
    """The Connect server's host in ``sc://host:port/;...``."""
    return urlparse(url.replace("sc://", "http://", 1)).hostname


def redact_url(text: str, url: str) -> str:
    """``text`` without the values of the URL's parameters (the token), as given or percent-encoded."""
    for param in url.partition("/;")[2].split(";"):
        value = param.partition("=")[2]
        if len(value) >= 4:
            for form in {value, unquote(value)}:
                text = text.replace(form, "***")
    return text


def local_slots(master: str, task_cpus: int) -> int | None:
    """The task slots of a ``local[N]`` server master (None: a cluster, or ``local[*]``)."""
    match = re.fullmatch(r"local\[(\d+)(,\d+)?\]|local", master.strip())
    if match is None:
        return None
    return int(match[1] or 1) // max(task_cpus, 1)


class SlotWatch:
    """Fails the run when not every barrier task has started within ``timeout`` seconds.

    A Connect client cannot see the cluster's executors; what it can see is whether the job's
    tasks reported in. A barrier stage starts all its tasks at once or none, so none by then means
    the cluster cannot fit the stage now (Spark's own check would wait about 10 minutes).
    """

    def __init__(self, channel: RunChannel, needed: int, timeout: float | None, cancel: Any) -> None:
        self._channel, self._needed, self._timeout, self._cancel = channel, needed, timeout, cancel
        self._done = threading.Event()
        #: Set when the watch gave up: the run's error.
        self.error: str | None = None

    def __enter__(self) -> SlotWatch:
        threading.Thread(target=self._watch, daemon=True, name="torchdist-slot-watch").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        start = time.monotonic()
        next_say = start + 10
        while not self._done.wait(1.0):
            started = len(self._channel.started_nodes)
            if started >= self._needed:
                return
            waited = time.monotonic() - start
            if self._timeout is not None and waited >= self._timeout:
                self.error = (
                    f"The barrier stage needs {self._needed} task slot(s) at once, and {started} of its tasks "
                    f"started within slot_timeout={self._timeout:.0f}s over Spark Connect: the cluster is too "
                    "small or busy, or its executors cannot reach the run channel on "
                    f"{self._channel.address[0]}:{self._channel.address[1]} (the connection's extra channel-host "
                    "sets it). Lower num_processes, raise nproc_per_node, or give the cluster more executors/cores."
                )
                self._cancel()
                return
            if time.monotonic() >= next_say:
                next_say += 10
                self._channel.say(
                    f"waiting for {self._needed - started} of {self._needed} barrier task(s) to start: the "
                    "stage needs all its task slots at once"
                )


#: What a Connect server takes in one gRPC message by default (``spark.connect.grpc.maxInboundMessageSize``).
DEFAULT_MAX_MESSAGE = 128 * 1024 * 1024
#: Room in the job's plan for what is not the payload (the pickled task function, the spec).
PLAN_ROOM = 1024 * 1024


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


def end_this_node() -> None:
    """The run's driver died (SIGKILLed, its machine lost) while the server's job goes on: end this
    node's ranks (SIGTERM, 5 s, SIGKILL) and its Python worker, instead of training for nobody;
    Spark then fails the task, and so the job."""
    import signal

    import psutil

    ranks = psutil.Process().children(recursive=True)  # torchrun's workers and theirs
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(ranks, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    os.kill(os.getpid(), signal.SIGKILL)  # this worker too: its task has no driver to report to


def connect_node_task(
    spec: JobSpec,
    channel_address: tuple[str, int],
    output_dir: str,
    entry: bytes,
    py_files: list[tuple[str, bytes]],
    rows: Iterator[Any],
) -> Iterator[Any]:
    """One barrier task of the job: write the payload and the user's ``py_files`` (``(name,
    bytes)``) privately, put the latter on the ranks' ``sys.path``, then run the node as
    :func:`.barrier.barrier_task` does."""
    import pyarrow as pa

    from airflow_provider_torchdist.spark.node.barrier import barrier_task

    # Read the task's input (its one row) to the end, or Spark will not reuse this Python worker.
    for _ in rows:
        pass
    environ = dict(os.environ)  # a reused worker must not hand this run's settings to the next task
    import_path = list(sys.path)

    directory = tempfile.mkdtemp(prefix=f"torchdist-connect-{os.getpid()}-")  # 0700
    try:
        shipped = [private_file(directory, name, data) for name, data in py_files]
        # As spark-submit's --py-files: first on the worker's sys.path, which the ranks (forked by
        # torchrun's agent) inherit.
        # A .py file is a module in its directory; a zip or egg is a path entry itself.
        entries = [p for p in shipped if not p.endswith(".py")]
        sys.path[:0] = [directory, *entries] if len(entries) < len(shipped) else entries
        # Module mode ships no entry: the module comes from py_files or the executors' Python.
        path = directory if spec.kind == "module" else private_file(directory, spec.entry, entry)
        # Rank 0 writes its value in place when this client's staging directory is on its machine
        # too (a server beside this worker), else streams it over the channel.
        for result in barrier_task(
            spec, channel_address, output_dir, iter(()), entry_path=path, on_driver_lost=end_this_node
        ):
            yield pa.RecordBatch.from_pydict({"result": [result]})
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = import_path  # nor this run's py_files


def private_file(directory: str, name: str, data: bytes) -> str:
    """``data`` in the 0600 file ``directory/<basename of name>``; returns its path."""
    return str(write_private_bytes(Path(directory, os.path.basename(name)), data))


def session_cache() -> Path:
    """Where this user keeps the ids of the Connect sessions its runs share (one per server and token)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "airflow-provider-torchdist" / "connect-sessions"


def with_session(url: str, session_id: str) -> str:
    """``url`` with ``session_id`` among its parameters."""
    return f"{url};session_id={session_id}" if "/;" in url else f"{url.rstrip('/')}/;session_id={session_id}"


def shared_session_id(url: str, cache: Path, renew: bool = False) -> str:
    """The session this user's runs against ``url`` share (a new one when ``renew`` or none yet).

    Spark Connect keeps Python workers per session: runs that share one find the server's workers
    up, torch imported, instead of starting them (about 1.4 s a run). The key covers the URL with
    its token, so different credentials never share a session.
    """
    path = cache / hashlib.sha256(f"{os.getuid()}|{url}".encode()).hexdigest()[:32]
    if not renew:
        with contextlib.suppress(OSError, ValueError):
            return str(uuid.UUID(path.read_text().strip(), version=4))
    session_id = str(uuid.uuid4())
    with contextlib.suppress(OSError):  # no cache: this run's session only
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private_text(path, session_id)
    return session_id


def planned_session_id(url: str) -> str | None:
    """The session a run against ``url`` will open (:func:`open_session`, unless the server closed
    it): the URL's own ``session_id``, or this user's shared one. None when the URL's is no UUID."""
    for param in url.partition("/;")[2].split(";"):
        name, _, value = param.partition("=")
        if name == "session_id":
            return canonical_uuid(value)
    return shared_session_id(url, session_cache())


def open_session(url: str) -> Any:
    """A Connect session for the run: the one this user's runs share, or a new one when the server
    closed it (idle too long) or the URL names a session of its own."""
    from pyspark.sql import SparkSession

    if "session_id=" in url:
        return SparkSession.builder.remote(url).create()
    cache = session_cache()
    spark = SparkSession.builder.remote(with_session(url, shared_session_id(url, cache))).create()
    try:
        spark.conf.get("spark.master")  # the server still has the session
    except Exception as exc:
        if "SESSION_CLOSED" not in str(exc) and "SESSION_CHANGED" not in str(exc):
            raise
        with contextlib.suppress(Exception):
            spark.client.close()
        spark = SparkSession.builder.remote(
            with_session(url, shared_session_id(url, cache, renew=True))
        ).create()
    return spark


def run_connect(spec: JobSpec, staging: Path, url: str, py_files: list[str] | None = None) -> Outcome:
    """The barrier stage over a Connect session, with the user's ``py_files`` (paths here, shipped
    inside the job); returns the run's outcome."""
    emit("spark_context_start")
    spark = open_session(url)
    emit("spark_context_up")
    tag = job_tag(spec.run_id)
    spark.addTag(tag)

    def interrupt() -> None:
        with contextlib.suppress(Exception):  # the session may be gone already
            spark.interruptTag(tag)

    def cancel(wait: float = 2.0) -> None:
        # pyspark retries a call to a slow server with backoff: a kill must not wait for it past
        # the hook's grace (5 s) before SIGKILL.
        worker = threading.Thread(target=interrupt, daemon=True)
        worker.start()
        worker.join(wait)

    def on_term(signum: int, frame: Any) -> None:
        cancel()
        signal.signal(signum, signal.SIG_DFL)  # then die of it at once, as an unhandled SIGTERM does
        os.kill(os.getpid(), signum)

    # Ended by the hook (a kill, a timeout, a lost owner): the job on the executors ends too.
    signal.signal(signal.SIGTERM, on_term)

    owner_token = read_owner_token(staging)
    nproc = spec.nproc_per_node
    server_driver_host = None
    conflicts: list[str] = []
    with contextlib.suppress(Exception):  # a server that hides its settings: the route to it
        server_driver_host = spark.conf.get("spark.driver.host", None)
    channel = RunChannel(
        spec.token,
        channel_host(url, server_driver_host, os.environ.get(CHANNEL_HOST_ENV)),
        staging,
        cancel,
        ranks_of_node=lambda n: range(n * nproc, (n + 1) * nproc),
        verify_node=ConnectVerifier(
            spec.num_nodes, on_conflict=lambda text: (conflicts.append(text), cancel())
        ),
        owner_token=owner_token,
        echo_stdout=owner_token is None,
        rank_filter=rank_filter(spec.log_ranks, staging),
    )
    error = None
    results: list[str] = []
    try:
        with channel:
            write_channel_address(staging, channel.address)
            channel.say(
                f"distributed mode over Spark Connect: {spec.num_nodes} Spark task(s) x "
                f"{spec.nproc_per_node} process(es), server {server_host(url)}, run channel on "
                f"{channel.address[0]}:{channel.address[1]} (the executors must reach it)"
            )
            if channel.rank_filter:
                channel.say(channel.rank_filter.announcement())
            app_id = None
            with contextlib.suppress(Exception):  # the server's application, for the log and the links
                app_id = spark.conf.get("spark.app.id", None)
            master, task_cpus = "", "1"
            with contextlib.suppress(Exception):  # a server that hides its settings: no local check
                master, task_cpus = spark.conf.get("spark.master", ""), spark.conf.get("spark.task.cpus", "1")
            slots = local_slots(master, int(task_cpus or 1))
            if slots is not None and slots < spec.num_nodes:
                raise SlotsUnavailable(spec.num_nodes, slots, f"the Connect server's master {master}")
            entry = b"" if spec.kind == "module" else (staging / spec.entry).read_bytes()
            shipped = [(Path(p).name, Path(p).read_bytes()) for p in py_files or []]
            check_payload_size(len(entry) + sum(len(data) for _, data in shipped), spark)
            task = functools.partial(connect_node_task, spec, channel.address, str(staging), entry, shipped)
            stage = spark.range(spec.num_nodes, numPartitions=spec.num_nodes)
            emit("barrier_stage_submitted")
            watch = SlotWatch(channel, spec.num_nodes, spec.slot_timeout, cancel)
            announce = OperationAnnouncer(channel, app_id, spark.session_id)
            spark.registerProgressHandler(announce.progress)
            try:
                with watch:
                    rows = stage.mapInArrow(task, "result string", barrier=True).collect()
                results = [row["result"] for row in rows]
            except Exception as exc:
                # A rank's report is the story; Connect's is only the interruption.
                error = watch.error or (conflicts[0] if conflicts else None)
                error = error or (None if channel.failures else first_line(exc))
            finally:
                spark.removeProgressHandler(announce.progress)
                announce.last_call()
            emit("barrier_stage_done")
            emit("channel_close")
        emit("channel_closed")
    finally:
        with contextlib.suppress(Exception):
            spark.removeTag(tag)
            # Close this client, but keep the session on the server for the next run (stop() would
            # release it, and its Python workers with it).
            spark.client.close()
    return Outcome(
        ok=not channel.failures and error is None,
        failures=channel.failures,
        error=error,
        hosts=hosts_of(results),
        metrics=channel.metrics,
        world_sizes=[started(spec.num_processes)],
    )


def main(argv: list[str], environ: dict[str, str] | None = None) -> int:
    """Run the job in ``argv[1]`` (with the user's py_files in ``argv[2:]``) over the Connect server
    in ``TORCHDIST_CONNECT_URL``; write the outcome."""
    spec_path = Path(argv[1])
    staging = spec_path.parent
    spec = JobSpec.read(spec_path)
    url = (environ if environ is not None else os.environ).get(URL_ENV, "")
    emit("driver_start")
    try:
        if not url:
            raise RuntimeError(f"{URL_ENV} is not set: the hook passes the Connect server's URL there")
        outcome = run_connect(spec, staging, url, argv[2:])
    except Exception as exc:
        outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {first_line(exc)}")
    if outcome.error:  # pyspark may quote the URL (and so the token) in its errors
        outcome = dataclasses.replace(outcome, error=redact_url(outcome.error, url))
    return finish(outcome, staging)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
