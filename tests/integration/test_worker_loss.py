"""Worker loss: a Spark Worker (its JVM and its executor's JVM) is SIGKILLed, or its host freezes, in
the middle of training; or Spark decommissions it (SIGPWR, as a spot node's notice does).

The run must end within a bounded time with an error that says a node was lost and where, and the
surviving worker must be left with nothing of the run: no executor, Python worker, agent or rank.
A decommissioned node's ranks checkpoint first: a fixed run then fails naming it and its retry
resumes from that checkpoint; an elastic run goes on without it from that checkpoint. With
checkpoints only in an S3 server (moto, a separate process on the bridge's address, reached by the
ranks over HTTP with s3fs and an Airflow connection's credentials), the retry of a run whose host
was killed resumes on the other host: the hosts share no directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import SparkSubmitFailed, TrainingFailed
from airflow_provider_torchdist.spark.node.checkpoint_manifest import RUN_ENV, run_env
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
from airflow_provider_torchdist.supervision.processes import command_line, is_alive
from tests.cluster import (
    ClusterInfo,
    WorkerInfo,
    cluster_logs,
    cluster_status,
    leftover_network,
    restart_lost_workers,
    start_cluster,
    stop_cluster,
    wait_idle,
)
from tests.cluster.netns import netns_pids
from tests.integration.connect_server import connect_on_cluster
from tests.object_store import S3Server, start_s3_server, stop_s3_server

pytestmark = pytest.mark.integration

PREFIX = "tdwl"
SUBNET = "10.231.91"
DRIVER_HOST = f"{SUBNET}.1"
#: How long after the loss the run may take to fail (the issue's bound).
FAIL_WITHIN_S = 60
#: Spark declares an executor lost when its heartbeats stop for spark.network.timeout (120 s by
#: default, checked every 60 s); the frozen-host test lowers it to stay well inside FAIL_WITHIN_S.
HEARTBEAT_TIMEOUT_15S = {
    "spark.network.timeout": "15s",
    "spark.executor.heartbeatInterval": "1s",
    "spark.network.timeoutInterval": "1s",
}


#: Spark's graceful decommissioning, on the Workers (SIGPWR decommissions one instead of ending it)
#: and in the application: the decommission tests below.
DECOMMISSION = {"spark.decommission.enabled": "true"}


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[ClusterInfo]:
    """Master + 2 one-core workers, each in its own network namespace (its own "host")."""
    if os.geteuid() != 0:
        pytest.fail("the worker-loss test needs root to create network namespaces (CI runs as root)")
    info = start_cluster(
        workers=2, cores=1, memory="1g", netns=True, prefix=PREFIX, subnet=SUBNET, worker_conf=DECOMMISSION
    )
    try:
        yield info
    finally:
        stop_cluster(info)
    assert not leftover_network(PREFIX)


@pytest.fixture
def cluster(two_hosts: ClusterInfo) -> ClusterInfo:
    """The module's cluster with both workers alive and idle: each test loses one, and the next starts
    it again; the earlier run's application and executors are gone before the next run counts slots."""
    restart_lost_workers(two_hosts)
    wait_idle(two_hosts)
    return two_hosts


def train_until_stopped(marker_dir: str, seconds: float) -> int:
    """Allreduce every 50 ms for ``seconds``; each rank first records its PID."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(marker_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps({"pid": os.getpid()}))
    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        t = torch.ones(4)
        dist.all_reduce(t)
        steps += 1
        time.sleep(0.05)
    dist.destroy_process_group()
    return steps


def _ancestors(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).parents()
    except psutil.NoSuchProcess:
        return []


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _run_tree(rank_pid: int, worker_pids: set[int]) -> dict[str, int]:
    """The processes between a rank and its Spark Worker: agent (Python worker), daemon, executor, Worker."""
    chain = _ancestors(rank_pid)
    found: dict[str, int] = {"rank": rank_pid}
    for proc in chain:
        cmd = _cmd(proc)
        if proc.pid in worker_pids:
            found["worker"] = proc.pid
            break
        if "CoarseGrainedExecutorBackend" in cmd:
            found["executor"] = proc.pid
        elif "agent" not in found:
            found["agent"] = proc.pid  # the Python worker (forked from the daemon) running torchrun's agent
        else:
            found["daemon"] = proc.pid  # pyspark.daemon
    assert {"agent", "executor", "worker"} <= set(found), f"unexpected tree above rank {rank_pid}: {found}"
    return found


# Node 1: a plain peer. Node 0: also the rendezvous endpoint and global rank 0, whose value is awaited.
# Killed: the host's processes die, so their sockets close. Frozen (SIGSTOP, like a host that hangs or
# drops off the network): nothing closes, the survivor blocks in gloo (whose timeout is 30 min) until
# Spark's heartbeat timeout, lowered here to 15 s, declares the executor lost.
@pytest.mark.parametrize(
    "lost_node, how",
    [(1, "killed"), (0, "killed"), (1, "frozen")],
    ids=["node-1-killed", "node-0-killed", "node-1-frozen"],
)
def test_worker_lost_mid_training_fails_the_run_clearly_and_leaves_nothing(
    lost_node: int,
    how: str,
    cluster: ClusterInfo,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_leftovers: None,
) -> None:
    hook = _cluster_hook(
        cluster, monkeypatch, extra_conf=HEARTBEAT_TIMEOUT_15S if how == "frozen" else {}, num_processes=2
    )
    errors: list[BaseException] = []
    result: list[object] = []

    def run() -> None:
        try:
            result.append(hook.run(train_until_stopped, str(tmp_path), 240.0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
        assert runner.is_alive() and time.monotonic() < deadline, f"ranks never started: {errors}"
        time.sleep(0.2)
    time.sleep(1.0)  # well into training: a few dozen allreduces done
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    worker_pids = {w.pid for w in cluster.workers}
    trees = {r: _run_tree(ranks[r]["pid"], worker_pids) for r in (0, 1)}
    assert trees[0]["worker"] != trees[1]["worker"], trees  # one rank per worker
    survivor = 1 - lost_node
    lost = next(w for w in cluster.workers if w.pid == trees[lost_node]["worker"])
    survivor_pids = {k: v for k, v in trees[survivor].items() if k != "worker"}

    # The host running one node goes away: its Worker JVM and its executor JVM die at once, or
    # everything of the run on it stops.
    frozen: list[psutil.Process] = []
    if how == "killed":
        for pid in (trees[lost_node]["worker"], trees[lost_node]["executor"]):
            os.kill(pid, signal.SIGKILL)
    else:
        frozen = [psutil.Process(trees[lost_node]["worker"])]
        frozen += frozen[0].children(recursive=True)
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
    killed_at = time.monotonic()
    try:
        runner.join(FAIL_WITHIN_S)
        took = time.monotonic() - killed_at
    finally:
        for proc in frozen:  # the frozen host's processes end with the test
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        # SIGKILL is delivered, not done, when it returns: a frozen JVM took seconds more to end, and
        # the next test, finding its Worker still alive and listed, ran one host short (CI, stop 37).
        _, still = psutil.wait_procs(frozen, timeout=30)
        assert not still, f"the frozen host's processes outlived their SIGKILL: {still}"
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail(f"the run was still going {FAIL_WITHIN_S}s after the worker was lost")

    assert not result, f"a run that lost a worker must not succeed: {result}"
    assert len(errors) == 1 and isinstance(errors[0], TrainingFailed | SparkSubmitFailed), errors
    message = str(errors[0])
    print(f"failed {took:.1f}s after the worker was {how}: {message}")
    # Says what happened, where, and to which ranks.
    assert (
        f"Spark lost the executor on {lost.host} that ran node(s) [{lost_node}] (rank(s) [{lost_node}])"
        in message
    )
    assert took < FAIL_WITHIN_S

    # Nothing of the run is left on the surviving worker: rank, agent, Python daemon, executor.
    deadline = time.monotonic() + 20
    while any(is_alive(pid) for pid in survivor_pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {name: pid for name, pid in survivor_pids.items() if is_alive(pid)}
    assert not left, f"left running on the surviving worker: {left}"
    assert is_alive(trees[survivor]["worker"])  # the surviving Worker itself is untouched


# Elastic runs (num_processes="MIN:MAX") on the same two hosts: the loss of a node is survived while
# MIN ranks remain, and fails the run, naming the loss, when fewer do.


def _cluster_hook(
    cluster: ClusterInfo,
    monkeypatch: pytest.MonkeyPatch,
    extra_conf: dict[str, str] | None = None,
    web_ui: bool = False,
    **settings: object,
) -> TorchDistributorHook:
    """A hook on the netns cluster's master, its driver on the test host (``extra_conf`` on top);
    ``web_ui``: the connection names the master's web UI, so the run knows the cluster's size."""
    conn: dict[str, object] = {
        "conn_type": "spark",
        "host": f"spark://{cluster.master_host}",
        "port": cluster.master_port,
    }
    if web_ui:
        conn["extra"] = {"master-web-ui": cluster.master_ui_url}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_WORKER_LOSS", json.dumps(conn))
    return TorchDistributorHook(
        conn_id="spark_worker_loss",
        conf={
            "spark.driver.host": DRIVER_HOST,
            "spark.driver.bindAddress": DRIVER_HOST,
            "spark.executor.memory": "512m",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            **(extra_conf or {}),
        },
        env_vars={"SPARK_LOCAL_IP": DRIVER_HOST},
        **settings,  # type: ignore[arg-type]
    )


def train_elastic(marker_dir: str, steps: int, hang_at: int | None = None) -> dict[str, int]:
    """``steps`` allreduces, resuming from the latest checkpoint; each worker group's ranks note
    their PID and world size in ``w<world size>-rank<rank>.json`` as they start. ``hang_at``: rank 1
    of the first group of 2 sleeps forever at that step, in this code, its PID in ``hung.json``."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start, state = load_latest_checkpoint() or (0, None)
    total = state["total"] if state else 0.0
    Path(marker_dir, f"w{world}-rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "start": start, "at": time.time()})
    )
    for step in range(start, steps):
        if step == hang_at and (world, rank) == (2, 1) and not Path(marker_dir, "hung.json").exists():
            Path(marker_dir, "hung.json").write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
            time.sleep(3600)  # the hung rank sleeps here
        t = torch.ones(1)
        dist.all_reduce(t)
        total += float(t.item())
        if step % 5 == 4:
            save_checkpoint({"total": total}, step + 1)
        time.sleep(0.05)
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "resumed_from": start}


#: The join window of the "1:2" runs, whose first group must hold both nodes: on a loaded machine the
#: second executor can register seconds after the first. A window costs nothing once MAX nodes joined;
#: after a loss, the survivor waits it out before it goes on alone.
JOIN_BOTH_S = 8


def _run_in_thread(
    hook: TorchDistributorHook, *args: object, train: Any = train_elastic
) -> tuple[threading.Thread, list, list]:
    result: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(hook.run(train, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, result, errors


def _wait_for_markers(directory: Path, names: list[str], runner: threading.Thread, errors: list) -> None:
    deadline = time.monotonic() + 150
    while not all((directory / n).exists() for n in names):
        assert runner.is_alive() and time.monotonic() < deadline, f"ranks never started: {errors}"
        time.sleep(0.1)


def _kill_host_of(rank_pid: int, cluster: ClusterInfo) -> WorkerInfo:
    """SIGKILL the Worker and executor JVMs above ``rank_pid``; returns that Worker."""
    tree = _run_tree(rank_pid, {w.pid for w in cluster.workers})
    lost = next(w for w in cluster.workers if w.pid == tree["worker"])
    for pid in (tree["worker"], tree["executor"]):
        os.kill(pid, signal.SIGKILL)
    return lost


def test_elastic_range_starts_with_the_free_slots(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    """ "2:4" on a cluster with 2 free slots: trains at world size 2; the 2 tasks that find no slot
    until the run is over end cleanly.

    The connection names the master's web UI: the run then knows the cluster fits MIN and waits for
    both executors. Without it, the driver guesses the cluster's size from the executors that
    register, and under a CPU hog the second registered more than the settle period after the
    first (hunt 10: SlotsUnavailable "needs 2 ... has 1"), which is that guess's documented limit."""
    hook = _cluster_hook(
        cluster,
        monkeypatch,
        num_processes="2:4",
        join_window=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        web_ui=True,
    )
    # In a thread: a cluster that fits MIN makes the driver wait for busy slots as long as it takes.
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 20)
    runner.join(240)
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail(
            f"the run did not finish within 240 s: {cluster_status(cluster)}\n{cluster_logs(cluster, 25)}"
        )
    assert not errors, errors
    value = result[0]
    assert value == {"rank": 0, "world_size": 2, "resumed_from": 0}
    assert [(e["world_size"], e["reason"]) for e in hook.world_sizes] == [(2, "start")]


@contextlib.contextmanager
def _engine_hook(
    engine: str, cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> Iterator[TorchDistributorHook]:
    """A hook on the netns cluster: spark-submit with its driver on the test host, or a Connect
    server of the test's own on the cluster (stopped afterwards, its application with it), whose
    client on the test host serves the run's channel and rendezvous store."""
    if engine == "spark-submit":
        yield _cluster_hook(cluster, monkeypatch, **settings)
        return
    with connect_on_cluster(cluster, monkeypatch) as conn_id:
        yield TorchDistributorHook(conn_id=conn_id, **settings)


@pytest.mark.parametrize("engine", ["spark-submit", "connect"])
def test_elastic_run_survives_losing_the_host_of_rank_0(
    engine: str, cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    """ "1:2" loses the host of rank 0 mid-training: the survivor goes on alone from the latest
    checkpoint, as rank 0 of world size 1, in the same run; nothing is left on the lost host.

    Over Spark Connect the loss is seen as the lost node's channel closing (the client has no
    SparkContext), and the rendezvous store lives in the client, on the test host."""
    settings = {"num_processes": "1:2", "join_window": JOIN_BOTH_S, "max_restarts": 2}
    with _engine_hook(
        engine, cluster, monkeypatch, checkpoint_dir=str(tmp_path / "ckpt"), **settings
    ) as hook:
        _survive_losing_the_host_of_rank_0(hook, cluster, tmp_path)


def _survive_losing_the_host_of_rank_0(
    hook: TorchDistributorHook, cluster: ClusterInfo, tmp_path: Path
) -> None:
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 300)
    _wait_for_markers(tmp_path, ["w2-rank0.json", "w2-rank1.json"], runner, errors)
    time.sleep(2.0)  # well into training: checkpoints written
    rank0 = json.loads((tmp_path / "w2-rank0.json").read_text())
    lost = _kill_host_of(rank0["pid"], cluster)
    killed_at = time.time()
    runner.join(240)
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the elastic run did not finish within 240 s of the loss")

    assert not errors, errors
    value = result[0]
    assert isinstance(value, dict)
    resumed = json.loads((tmp_path / "w1-rank0.json").read_text())
    print(
        f"training resumed at world size 1 {resumed['at'] - killed_at:.1f}s after the loss, from step {resumed['start']}"
    )
    assert value["rank"] == 0 and value["world_size"] == 1  # the last generation's rank 0
    assert value["resumed_from"] == resumed["start"] > 0  # from the checkpoint, not from scratch
    sizes = hook.world_sizes
    assert [e["world_size"] for e in sizes] == [2, 1], sizes
    assert sizes[1]["reason"] == f"lost the node on {lost.host}"
    assert sizes[0]["time"] < killed_at < sizes[1]["time"]
    # Nothing of the run is left on the lost host (its namespace holds no process).
    assert lost.netns is not None
    deadline = time.monotonic() + 20
    while netns_pids(lost.netns) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: command_line(pid)[:120] for pid in netns_pids(lost.netns)}
    assert not left, f"left running on the lost host: {left}"


def test_elastic_run_below_min_fails_naming_the_loss(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    """ "2:3" with one slot left after a loss: no replacement can join, so the run fails after
    rendezvous_timeout, naming the lost node."""
    hook = _cluster_hook(
        cluster,
        monkeypatch,
        num_processes="2:3",
        join_window=2,
        max_restarts=2,
        rendezvous_timeout=20,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 600)
    _wait_for_markers(tmp_path, ["w2-rank0.json", "w2-rank1.json"], runner, errors)
    time.sleep(1.0)
    rank1 = json.loads((tmp_path / "w2-rank1.json").read_text())
    lost = _kill_host_of(rank1["pid"], cluster)
    killed_at = time.monotonic()
    runner.join(120)
    took = time.monotonic() - killed_at
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the elastic run below MIN was still going 120 s after the loss")

    assert not result, result
    assert len(errors) == 1 and isinstance(errors[0], TrainingFailed), errors
    message = str(errors[0])
    print(f"failed {took:.1f}s after the loss: {message}")
    assert f"the node on {lost.host} (lost at" in message
    assert "fewer than MIN=2 ranks" in message


@pytest.mark.parametrize("engine", ["spark-submit", "connect"])
def test_elastic_run_grows_back_when_the_lost_host_returns(
    engine: str, cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    """ "1:2" loses the host of rank 1, goes on at world size 1, and takes the host back in when its
    Worker returns: Spark's task retry runs the lost node again there, and it joins at the next
    rendezvous. Over Spark Connect, the server's application gets an executor there again."""
    settings = {"num_processes": "1:2", "join_window": JOIN_BOTH_S, "max_restarts": 3}
    with _engine_hook(
        engine, cluster, monkeypatch, checkpoint_dir=str(tmp_path / "ckpt"), **settings
    ) as hook:
        _grow_back_when_the_lost_host_returns(hook, cluster, tmp_path)


def _grow_back_when_the_lost_host_returns(
    hook: TorchDistributorHook, cluster: ClusterInfo, tmp_path: Path
) -> None:
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 900)
    _wait_for_markers(tmp_path, ["w2-rank0.json", "w2-rank1.json"], runner, errors)
    time.sleep(1.0)
    rank1 = json.loads((tmp_path / "w2-rank1.json").read_text())
    lost = _kill_host_of(rank1["pid"], cluster)
    _wait_for_markers(tmp_path, ["w1-rank0.json"], runner, errors)
    assert restart_lost_workers(cluster) == [lost.index]  # the host's Worker is back
    runner.join(240)
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the elastic run did not finish within 240 s")

    assert not errors, errors
    assert result[0]["world_size"] == 2  # the last generation had both hosts again
    sizes = hook.world_sizes
    assert [(e["world_size"], e["reason"]) for e in sizes] == [
        (2, "start"),
        (1, f"lost the node on {lost.host}"),
        (2, "a node joined"),
    ], sizes


def test_a_hung_node_of_an_elastic_run_is_dropped_as_a_lost_node_and_the_run_finishes_without_it(
    cluster: ClusterInfo,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    no_leftovers: None,
) -> None:
    """ "1:2" whose rank 1 sleeps forever in user code at step 10 while rank 0 waits in all_reduce:
    the hang watch names it with its stack (hang_timeout=10), its node leaves the run as a lost node
    (its rank killed by PID, its task ended), and rank 0 goes on alone from the step-10 checkpoint
    to the end of the run (docs/hangs.md, "Elastic runs")."""
    hook = _cluster_hook(
        cluster,
        monkeypatch,
        num_processes="1:2",
        join_window=JOIN_BOTH_S,
        max_restarts=2,
        hang_timeout=10,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 80, 10)
    _wait_for_markers(tmp_path, ["hung.json"], runner, errors)
    hung = json.loads((tmp_path / "hung.json").read_text())
    tree = _run_tree(hung["pid"], {w.pid for w in cluster.workers})
    host = next(w for w in cluster.workers if w.pid == tree["worker"]).host
    runner.join(240)
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the elastic run did not finish within 240 s of the hang")

    assert not errors, errors
    assert result[0] == {"rank": 0, "world_size": 1, "resumed_from": 10}  # from the checkpoint
    sizes = hook.world_sizes
    assert [(e["world_size"], e["reason"]) for e in sizes] == [(2, "start"), (1, f"the node on {host} hung")]
    assert sizes[1]["time"] - hung["at"] < 10 + 30 + JOIN_BOTH_S  # found, dropped, met again
    assert not is_alive(hung["pid"])  # killed, by PID (the no_leftovers fixture checks the rest)
    log = "".join(capfd.readouterr())
    print(
        "\n".join(
            line for line in log.splitlines() if "hang: " in line or "elastic" in line or "leaves" in line
        )
    )
    assert f"stacks of [rank 1 @ {host}]:" in log
    assert "time.sleep(3600)  # the hung rank sleeps here" in log
    assert (
        f"hang: suspect: rank 1 on {host} (not in a collective, or silent, while rank(s) [0] wait in one)"
        in log
    )
    assert f"on {host} leave(s) the run as a lost node: its ranks are killed" in log
    assert "the driver found this node hung: its ranks were killed and it leaves the run" in log


# Spark's own decommission of one Worker (SIGPWR, with spark.decommission.enabled): the ranks get the
# graceful stop first (stop_requested() turns True), so nothing since the last checkpoint is lost.


def train_until_decommissioned(marker_dir: str, steps: int) -> dict[str, int]:
    """``train_elastic`` that also stops when asked: every rank at the same step, rank 0 saving a
    checkpoint there. Rank 0 logs each step it trains (``steps.log``: world size and step)."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint, stop_requested

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start, state = load_latest_checkpoint() or (0, None)
    total = state["total"] if state else 0.0
    Path(marker_dir, f"w{world}-rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "start": start, "at": time.time()})
    )
    for step in range(start, steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        total += float(t.item())
        if rank == 0:
            with open(Path(marker_dir, "steps.log"), "a") as log:
                log.write(f"{world} {step}\n")
        if stop_requested(all_ranks=True):
            save_checkpoint({"total": total}, step + 1)
            if rank == 0:
                Path(marker_dir, f"stopped-w{world}.json").write_text(json.dumps({"next": step + 1}))
            return {"rank": rank, "world_size": world, "resumed_from": start, "stopped_at": step + 1}
        if step % 5 == 4:
            save_checkpoint({"total": total}, step + 1)
        time.sleep(0.05)
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "resumed_from": start}


def fsdp_model_and_batch():
    """A small MLP (every rank builds the same one) and the batch every rank trains on at every step:
    the same data on each rank, so the loss curve is the same at any world size."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 8, generator=generator), torch.randn(64, 4, generator=generator)


def train_fsdp_until_decommissioned(marker_dir: str, steps: int) -> dict[str, int]:
    """``train_until_decommissioned`` with an FSDP2 model (``fully_shard``, gloo): each rank holds
    half of each parameter and of Adam's state, checkpoints are sharded (DCP), and a resume on
    another world size is resharded. Rank 0 also logs each step's loss (``losses.log``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint, stop_requested

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = fsdp_model_and_batch()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def state() -> dict:
        return dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))

    start = 0
    if found := load_latest_checkpoint(state=state()):
        start, loaded = found
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    Path(marker_dir, f"w{world}-rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "start": start, "at": time.time()})
    )
    for step in range(start, steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            with open(Path(marker_dir, "steps.log"), "a") as log:
                log.write(f"{world} {step}\n")
            with open(Path(marker_dir, "losses.log"), "a") as log:
                log.write(f"{step} {loss.item()!r}\n")
        if stop_requested(all_ranks=True):
            save_checkpoint(state(), step + 1)
            if rank == 0:
                Path(marker_dir, f"stopped-w{world}.json").write_text(json.dumps({"next": step + 1}))
            return {"rank": rank, "world_size": world, "resumed_from": start, "stopped_at": step + 1}
        if step % 5 == 4:
            save_checkpoint(state(), step + 1)
        time.sleep(0.05)
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "resumed_from": start}


def fsdp_losses(steps: int) -> list[float]:
    """The loss of each step of the same training, unsharded in this process: the curve a resharded
    resume must continue."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, x, y = fsdp_model_and_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    get_state_dict(model, optimizer)  # as the ranks do before their first step: it makes Adam's state
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _decommission_host_of(rank_pid: int, cluster: ClusterInfo) -> WorkerInfo:
    """SIGPWR to the Worker above ``rank_pid``: Spark decommissions it and its executor."""
    tree = _run_tree(rank_pid, {w.pid for w in cluster.workers})
    worker = next(w for w in cluster.workers if w.pid == tree["worker"])
    os.kill(worker.pid, signal.SIGPWR)
    return worker


def _steps_trained(marker_dir: Path) -> list[tuple[int, int]]:
    """(world size, step) of every step rank 0 trained, in order."""
    return [tuple(map(int, line.split())) for line in (marker_dir / "steps.log").read_text().splitlines()]


def _retire(worker: WorkerInfo, marker_dir: Path) -> None:
    """End the decommissioned Worker once its executor has gone, so that the next test starts it
    again (``restart_lost_workers``); nothing of the run may be left in its namespace."""
    assert worker.netns is not None
    deadline = time.monotonic() + 30
    while set(netns_pids(worker.netns)) - {worker.pid} and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: command_line(pid)[:120] for pid in set(netns_pids(worker.netns)) - {worker.pid}}
    os.kill(worker.pid, signal.SIGKILL)
    # SIGKILL is delivered, not done, when kill returns: restart_lost_workers must see it gone.
    deadline = time.monotonic() + 15
    while is_alive(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running on the decommissioned host: {left}"


def test_a_decommissioned_workers_fixed_run_checkpoints_fails_naming_it_and_its_retry_resumes(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    settings = {"num_processes": 2, "checkpoint_dir": str(tmp_path / "ckpt"), "stop_grace_period": 20}
    hook = _cluster_hook(cluster, monkeypatch, extra_conf=DECOMMISSION, **settings)
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 2000, train=train_until_decommissioned)
    _wait_for_markers(tmp_path, ["w2-rank0.json", "w2-rank1.json"], runner, errors)
    time.sleep(1.0)
    rank1 = json.loads((tmp_path / "w2-rank1.json").read_text())
    worker = _decommission_host_of(rank1["pid"], cluster)
    signalled = time.monotonic()
    runner.join(60)
    took = time.monotonic() - signalled
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the run was still going 60 s after its Worker was decommissioned")
    _retire(worker, tmp_path)

    assert not result and len(errors) == 1 and isinstance(errors[0], TrainingFailed), (result, errors)
    message = str(errors[0])
    print(f"failed {took:.1f} s after the decommission: {message}")
    assert (
        f"node decommissioned: Spark decommissioned the executor on {worker.host} that ran node(s) [1]"
        in message
    )
    assert took < 20  # the ranks returned at their next step, well inside the grace period
    stopped = json.loads((tmp_path / "stopped-w2.json").read_text())["next"]
    assert stopped > 0

    # The retry (on the Worker started again) resumes from that checkpoint: no step twice.
    assert restart_lost_workers(cluster) == [worker.index]
    value = _cluster_hook(cluster, monkeypatch, **settings).run(
        train_until_decommissioned, str(tmp_path), stopped + 10
    )
    assert value == {"rank": 0, "world_size": 2, "resumed_from": stopped}
    assert [step for _, step in _steps_trained(tmp_path)] == list(range(stopped + 10))


def test_a_decommissioned_workers_elastic_run_shrinks_after_the_checkpoint(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_leftovers: None
) -> None:
    """ "1:2" with the host of rank 0 decommissioned: every rank checkpoints at the same step, that
    node leaves, and the other goes on alone from that step (not from an older checkpoint). The
    model is FSDP2-sharded over the 2 ranks: the sharded checkpoint is resharded onto the one left,
    and the loss curve goes on as one unstopped, unsharded training's would."""
    hook = _cluster_hook(
        cluster,
        monkeypatch,
        extra_conf=DECOMMISSION,
        num_processes="1:2",
        join_window=JOIN_BOTH_S,
        max_restarts=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        stop_grace_period=8,
    )
    runner, result, errors = _run_in_thread(hook, str(tmp_path), 300, train=train_fsdp_until_decommissioned)
    _wait_for_markers(tmp_path, ["w2-rank0.json", "w2-rank1.json"], runner, errors)
    time.sleep(1.0)
    rank0 = json.loads((tmp_path / "w2-rank0.json").read_text())
    worker = _decommission_host_of(rank0["pid"], cluster)
    runner.join(180)
    if runner.is_alive():
        hook.on_kill()
        runner.join(30)
        pytest.fail("the elastic run did not finish within 180 s of the decommission")
    _retire(worker, tmp_path)

    assert not errors, errors
    stopped = json.loads((tmp_path / "stopped-w2.json").read_text())["next"]
    assert result[0] == {"rank": 0, "world_size": 1, "resumed_from": stopped}
    sizes = hook.world_sizes
    assert [(e["world_size"], e["reason"]) for e in sizes] == [
        (2, "start"),
        (1, f"the node on {worker.host} was decommissioned"),
    ], sizes
    # Every step once: world size 2 up to the stop, then world size 1 from there on.
    trained = _steps_trained(tmp_path)
    assert trained == [(2, s) for s in range(stopped)] + [(1, s) for s in range(stopped, 300)]
    # Resharded from 2 ranks to 1, the state is exactly where it was: the same curve, step by step.
    lines = (tmp_path / "losses.log").read_text().split()
    losses = dict(zip(map(int, lines[::2]), map(float, lines[1::2]), strict=True))
    assert sorted(losses) == list(range(300))
    assert [losses[s] for s in range(300)] == pytest.approx(fsdp_losses(300), rel=1e-4, abs=1e-6)
    assert list((tmp_path / "ckpt").glob("step-*/dcp.metadata")), "no sharded checkpoint was kept"


#: The multi-host checkpoint test: steps between checkpoints, and steps in all.
EVERY = 2
STEPS = 300


@pytest.fixture(scope="module")
def bridge_s3(two_hosts: ClusterInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3 server on the bridge's address, where the namespaced hosts reach it."""
    proc, server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log", host=DRIVER_HOST)
    try:
        yield server
    finally:
        stop_s3_server(proc)


def train_checkpointing(marker_dir: str, steps: int, every: int) -> dict:
    """Resume from the store, then a step every 50 ms, a checkpoint every ``every`` steps; each
    step noted in ``<marker_dir>/progress-<pid>.json`` (the test's view only, not a checkpoint)."""
    import torch

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    start, state = load_latest_checkpoint() or (0, None)
    total = float(state["total"]) if state else 0.0
    progress = Path(marker_dir, f"progress-{os.getpid()}.json")
    host = os.environ["MASTER_ADDR"]  # one rank: its own host's routable address
    for step in range(start, steps):
        total += 1.0
        if (step + 1) % every == 0:
            save_checkpoint({"total": torch.tensor(total)}, step + 1)
        # Written whole, then renamed: the test reads it while the rank trains (a plain write_text
        # was once read empty).
        progress.with_suffix(".tmp").write_text(
            json.dumps({"pid": os.getpid(), "start": start, "step": step + 1, "host": host})
        )
        os.replace(progress.with_suffix(".tmp"), progress)
        time.sleep(0.05)
    return {"start": start, "total": total}


def test_the_retry_on_the_other_host_resumes_from_the_object_store(
    cluster: ClusterInfo, bridge_s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_STORE", bridge_s3.connection_uri_env())
    uri = f"s3://{bridge_s3.bucket()}/retrain"
    markers = tmp_path / "markers"
    markers.mkdir()

    def hook() -> TorchDistributorHook:  # each try of the same task in the same DAG run
        return _cluster_hook(
            cluster,
            monkeypatch,
            num_processes=1,
            checkpoint_dir=uri,
            checkpoint_conn_id="ckpt_store",
            rank_env={RUN_ENV: run_env("retrain", "scheduled__1", "train", -1, 1)},
        )

    errors: list[BaseException] = []

    def first_try() -> None:
        try:
            hook().run(train_checkpointing, str(markers), STEPS, EVERY)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    runner = threading.Thread(target=first_try, daemon=True)
    runner.start()
    store = CheckpointStore(uri, bridge_s3.storage_options)
    deadline = time.monotonic() + 180
    while not [m for m in store.committed() if m.step >= 3 * EVERY]:  # a few checkpoints in the store
        assert runner.is_alive() and time.monotonic() < deadline, f"no checkpoint reached the store: {errors}"
        time.sleep(0.2)
    (first,) = [json.loads(p.read_text()) for p in markers.glob("progress-*.json")]
    lost = _kill_host_of(first["pid"], cluster)
    runner.join(180)
    assert not runner.is_alive() and errors, "the try whose host was killed must fail"
    reached = json.loads(next(markers.glob(f"progress-{first['pid']}.json")).read_text())["step"]
    saved = max(m.step for m in store.committed())

    result = hook().run(train_checkpointing, str(markers), STEPS, EVERY)

    assert result["start"] == saved >= reached - EVERY  # at most one checkpoint interval lost
    assert result["total"] == float(STEPS)  # every step counted once: nothing trained twice
    (retry,) = [
        json.loads(p.read_text())
        for p in markers.glob("progress-*.json")
        if p.stem != f"progress-{first['pid']}"
    ]
    assert retry["start"] == saved and retry["host"] != lost.host == first["host"]
