"""Integration tests for ``tests.cluster``: a real Spark standalone cluster plus spark-submit.

The netns test is the one that matters for distributed training: every Worker lives in its own
network namespace, so a 2-task barrier stage must land on two different IP addresses, and executors
must reach the driver (and each other) over the bridge.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from airflow_provider_torchdist.supervision.processes import is_alive
from tests.cluster import (
    check_netns_connectivity,
    cluster_processes,
    cluster_status,
    leftover_network,
    spark_cluster,
    start_cluster,
    stop_cluster,
)
from tests.cluster.__main__ import main as cluster_cli

pytestmark = pytest.mark.integration

# Own prefix and subnet, so these tests neither clobber nor collide with a cluster started by hand
# with the CLI defaults (td / 10.231.0).
NETNS_PREFIX = "tdit"
NETNS_SUBNET = "10.231.77"
RESULT_MARK = "BARRIER_RESULT "

# Runs on the driver; the barrier tasks report where they actually ran.
PROBE_APP = textwrap.dedent(
    """
    import json
    import os
    import socket
    import sys

    from pyspark import BarrierTaskContext, SparkContext

    driver_host = sys.argv[1]


    def probe(_rows):
        ctx = BarrierTaskContext.get()
        ctx.barrier()  # all tasks of the stage must be running at the same time
        # Source address of a route to the driver = this executor's own interface address.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((driver_host, 9))
            local_ip = s.getsockname()[0]
        yield {
            "partition": ctx.partitionId(),
            "addresses": [info.address for info in ctx.getTaskInfos()],
            "local_ip": local_ip,
            "netns": os.readlink("/proc/self/ns/net"),
            "spark_local_ip": os.environ.get("SPARK_LOCAL_IP"),
            "python": sys.executable,
        }


    sc = SparkContext(appName="spark-cluster-barrier-probe")
    try:
        rows = sc.parallelize(range(2), 2).barrier().mapPartitions(probe).collect()
    finally:
        sc.stop()
    print("BARRIER_RESULT " + json.dumps(rows), flush=True)
    """
)


def require_java() -> None:
    """Fail, never skip: a skipped test proves nothing."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("needs java (Java 17) for Spark")


def require_netns() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("needs root and iproute2 to create network namespaces")


def _submit_probe(info, tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    """spark-submit the barrier probe in client mode; return the per-task records."""
    app = tmp_path / "barrier_probe.py"
    app.write_text(PROBE_APP)
    extra = {
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.cores.max": "2",
        # Hold the job until both executors are registered: a barrier stage submitted with too few
        # slots is only re-checked every 15 s by default.
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.ui.enabled": "false",
    }
    cmd = [info.spark_submit, *info.spark_submit_args(extra), "--driver-memory", "512m", str(app)]
    cmd.append(info.driver_host)
    proc = subprocess.Popen(
        cmd,
        env=info.driver_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a hung driver can be killed with everything it started
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"spark-submit timed out after {timeout}s:\n{err[-4000:]}")
    assert proc.returncode == 0, f"spark-submit failed ({proc.returncode}):\n{err[-6000:]}"
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"no result line in driver output:\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1][len(RESULT_MARK) :])


def _assert_stopped(info) -> None:
    """Nothing the cluster started is alive, and its namespaces/devices are gone."""
    assert not cluster_processes(info), "cluster processes survived stop_cluster"
    alive = [pid for pid in info.pids if is_alive(pid)]
    assert not alive, f"daemon PIDs still alive: {alive}"
    assert leftover_network(info.prefix) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(info.netns_names) & set(namespaces)


def test_barrier_stage_spans_two_network_namespaces(tmp_path: Path) -> None:
    require_java()
    require_netns()
    # Leftovers of a crashed run with this prefix: `up` must remove them first.
    subprocess.run(["ip", "netns", "add", f"{NETNS_PREFIX}-w9"], check=True)
    subprocess.run(["ip", "link", "add", f"{NETNS_PREFIX}br0", "type", "bridge"], check=True)
    info = start_cluster(
        workers=2,
        cores=1,
        memory="1g",
        netns=True,
        prefix=NETNS_PREFIX,
        subnet=NETNS_SUBNET,
        state_dir=tmp_path / "cluster",
    )
    try:
        assert info.master_url == f"spark://{NETNS_SUBNET}.1:{info.master_port}"
        assert info.driver_host == f"{NETNS_SUBNET}.1"
        assert info.worker_hosts == [f"{NETNS_SUBNET}.11", f"{NETNS_SUBNET}.12"]
        assert info.netns_names == [f"{NETNS_PREFIX}-w1", f"{NETNS_PREFIX}-w2"]
        assert f"{NETNS_PREFIX}-w9" not in leftover_network(NETNS_PREFIX)
        # Already done by start_cluster; repeated here so a network problem fails with its own message.
        check_netns_connectivity(info)
        state = json.loads((tmp_path / "cluster" / "state.json").read_text())
        assert state["master_pid"] == info.master_pid
        assert [w["netns"] for w in state["workers"]] == info.netns_names

        rows = _submit_probe(info, tmp_path)
    finally:
        stop_cluster(info)
    _assert_stopped(info)

    assert sorted(r["partition"] for r in rows) == [0, 1]
    by_partition = {r["partition"]: r for r in rows}
    addresses = by_partition[0]["addresses"]
    assert by_partition[1]["addresses"] == addresses
    hosts = [a.rsplit(":", 1)[0] for a in addresses]
    assert sorted(hosts) == sorted(info.worker_hosts), addresses
    for partition, row in by_partition.items():
        # Each task really runs on the IP it is advertised under ...
        assert row["local_ip"] == hosts[partition]
        assert row["spark_local_ip"] == row["local_ip"]
        assert row["python"] == info.python
    # ... and in two different namespaces, neither of them the driver's.
    namespaces = {r["netns"] for r in rows}
    assert len(namespaces) == 2
    assert os.readlink("/proc/self/ns/net") not in namespaces


def test_loopback_cluster_runs_barrier_stage(tmp_path: Path) -> None:
    require_java()
    with spark_cluster(workers=2, cores=1, memory="1g", prefix="tdlo", state_dir=tmp_path / "c") as info:
        assert info.master_host == "127.0.0.1"
        assert info.worker_hosts == ["127.0.0.1", "127.0.0.1"]
        assert not info.netns_names
        status = cluster_status(info)
        assert status["alive_workers"] == 2
        rows = _submit_probe(info, tmp_path)
    _assert_stopped(info)

    addresses = rows[0]["addresses"]
    assert len(set(addresses)) == 2, addresses  # two executors ...
    assert {a.rsplit(":", 1)[0] for a in addresses} == {"127.0.0.1"}  # ... both on loopback
    assert {r["local_ip"] for r in rows} == {"127.0.0.1"}


def test_down_without_state_removes_stale_network(tmp_path: Path) -> None:
    require_java()
    require_netns()
    prefix = "tdst"
    # Leftovers of a "crashed" run: a namespace and a bridge with the prefix, no state anywhere.
    subprocess.run(["ip", "netns", "add", f"{prefix}-w1"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}br0", "type", "bridge"], check=True)
    try:
        assert sorted(leftover_network(prefix)) == sorted([f"{prefix}-w1", f"{prefix}br0"])
        rc = cluster_cli(["down", "--prefix", prefix, "--state-dir", str(tmp_path / "none")])
        assert rc == 0
        assert leftover_network(prefix) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"{prefix}-w1"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{prefix}br0"], capture_output=True)
