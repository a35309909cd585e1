"""Worker loss: a Spark Worker (its JVM and its executor's JVM) is SIGKILLed, or its host freezes, in
the middle of training.

The run must end within a bounded time with an error that says a node was lost and where, and the
surviving worker must be left with nothing of the run: no executor, Python worker, agent or rank.
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

import psutil
import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import SparkSubmitFailed, TrainingFailed
from tests.cluster import ClusterInfo, leftover_network, start_cluster, stop_cluster

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


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterInfo]:
    """Master + 4 one-core workers, each in its own network namespace (its own "host").

    Each test loses one worker and a run takes two, so the three tests share one cluster.
    """
    if os.geteuid() != 0:
        pytest.fail("the worker-loss test needs root to create network namespaces (CI runs as root)")
    info = start_cluster(workers=4, cores=1, memory="1g", netns=True, prefix=PREFIX, subnet=SUBNET)
    try:
        yield info
    finally:
        stop_cluster(info)
    assert not leftover_network(PREFIX)


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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    conn = {"conn_type": "spark", "host": f"spark://{cluster.master_host}", "port": cluster.master_port}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_WORKER_LOSS", json.dumps(conn))
    hook = TorchDistributorHook(
        num_processes=2,
        conn_id="spark_worker_loss",
        conf={
            "spark.driver.host": DRIVER_HOST,
            "spark.driver.bindAddress": DRIVER_HOST,
            "spark.executor.memory": "512m",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            **(HEARTBEAT_TIMEOUT_15S if how == "frozen" else {}),
        },
        env_vars={"SPARK_LOCAL_IP": DRIVER_HOST},
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
    while any(_alive(pid) for pid in survivor_pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {name: pid for name, pid in survivor_pids.items() if _alive(pid)}
    assert not left, f"left running on the surviving worker: {left}"
    assert _alive(trees[survivor]["worker"])  # the surviving Worker itself is untouched
