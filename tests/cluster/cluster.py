"""The cluster as a whole: bring it up, report on it, take it down leaving nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.supervision.processes import command_line, is_alive
from tests.cluster.daemons import (
    cluster_processes,
    fetch_master_json,
    find_spark_home,
    is_spark_daemon,
    registered_worker_ids,
    start_master,
    start_worker,
    stop_daemons,
    wait_master_alive,
    wait_registered,
)
from tests.cluster.netns import (
    check_netns_connectivity,
    cleanup_network,
    leftover_network,
    netns_pids,
    setup_network,
    worker_names,
)
from tests.cluster.state import (
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    ClusterError,
    ClusterInfo,
    WorkerInfo,
    register,
    registry_file,
    unregister,
    validate_names,
    write_state,
)


def start_cluster(
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    netns: bool = False,
    state_dir: str | os.PathLike[str] | None = None,
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    python: str | None = None,
    timeout: float = 120.0,
    daemon_memory: str = "256m",
    parallel_start: bool = False,
    worker_conf: dict[str, str] | None = None,
) -> ClusterInfo:
    """Start a Master and `workers` Workers and wait until all Workers are registered.

    Args:
        workers: number of Worker daemons.
        cores: cores each Worker offers (keep workers*cores near the machine's core count).
        memory: memory each Worker offers to its executors, e.g. ``"1g"``.
        netns: put each Worker in its own network namespace behind a bridge (needs root).
        state_dir: where logs, work dirs and ``state.json`` go; a new temp dir if None.
        prefix: name prefix of namespaces/devices and of the registry entry; one live cluster per prefix.
        subnet: /24 used with ``netns`` (``<subnet>.1`` = bridge/master/driver, ``<subnet>.11+`` = workers);
            concurrent netns clusters need different prefixes *and* subnets.
        python: interpreter for PySpark (default: the caller's ``sys.executable``).
        timeout: seconds to wait for the Master and all Worker registrations.
        daemon_memory: heap of the Master/Worker JVMs themselves (SPARK_DAEMON_MEMORY).
        parallel_start: boot the Worker JVMs together with the Master instead of once the Master is
            ALIVE.  Saves the Worker boot time when the Master wins the race, but a Worker that
            registers before the Master is leader retries only after 5-15 s (hard-coded in Spark),
            which measured as the common case on a busy 2-core machine.
        worker_conf: Spark properties for every Worker daemon (``SPARK_WORKER_OPTS``), e.g.
            ``{"spark.worker.resource.gpu.amount": "2", "spark.worker.resource.gpu.discoveryScript": ...}``.

    Returns:
        ClusterInfo, also written to ``<state_dir>/state.json``.

    Raises:
        ClusterError: with the relevant log tail; anything already started is stopped again.
    """
    t0 = time.monotonic()
    validate_names(prefix, subnet)
    if workers < 1 or cores < 1:
        raise ClusterError("workers and cores must be >= 1")
    if netns and workers > 200:
        raise ClusterError("at most 200 workers with --netns (addresses <subnet>.11 .. .210)")
    if netns and os.geteuid() != 0:
        raise ClusterError("--netns needs root (ip netns / bridge devices)")
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        raise ClusterError("java not found (PATH / JAVA_HOME)")
    python = python or sys.executable
    spark_home = find_spark_home()

    _clean_stale(prefix, netns)

    owns_state_dir = state_dir is None
    sdir = Path(tempfile.mkdtemp(prefix=f"torchdist-spark-{prefix}-") if state_dir is None else state_dir)
    sdir = sdir.resolve()
    sdir.mkdir(parents=True, exist_ok=True)
    (sdir / "conf").mkdir(exist_ok=True)
    host = f"{subnet}.1" if netns else "127.0.0.1"
    timings: dict[str, float] = {}

    info = ClusterInfo(
        master_url="",
        master_ui_url="",
        master_host=host,
        master_port=0,
        master_ui_port=0,
        master_pid=0,
        master_log=str(sdir / "master.log"),
        driver_host=host,
        workers=[],
        cores=cores,
        memory=memory,
        netns=netns,
        prefix=prefix,
        subnet=subnet if netns else None,
        bridge=f"{prefix}br0" if netns else None,
        state_dir=str(sdir),
        spark_home=spark_home,
        python=python,
        timings=timings,
        owns_state_dir=owns_state_dir,
        worker_conf=dict(worker_conf or {}),
    )
    for i in range(1, workers + 1):
        ns, host_veth, _ = worker_names(prefix, i)
        info.workers.append(
            WorkerInfo(
                index=i,
                host=f"{subnet}.{10 + i}" if netns else "127.0.0.1",
                pid=0,
                log=str(sdir / f"worker-{i}.log"),
                work_dir=str(sdir / f"worker-{i}" / "work"),
                netns=ns if netns else None,
                host_veth=host_veth if netns else None,
            )
        )

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {"master": info.master_log, **{f"worker-{w.index}": w.log for w in info.workers}}
    try:
        if netns:
            t = time.monotonic()
            setup_network(prefix, subnet, workers)
            timings["network_setup"] = time.monotonic() - t
        # Early, so `down` (and the next `up`) find the daemons even if this process dies half-way.
        write_state(info)
        register(info)

        procs["master"] = start_master(info, daemon_memory)
        write_state(info)

        if netns:
            # Runs while the Master JVM boots, before any Worker starts: a broken bridge/veth then
            # fails here with a precise message instead of as a registration timeout.
            t = time.monotonic()
            check_netns_connectivity(info)
            timings["connectivity_check"] = time.monotonic() - t

        deadline = time.monotonic() + timeout
        if not parallel_start:
            wait_master_alive(info, deadline, procs, logs)
            timings["master_alive"] = time.monotonic() - t0
        for w in info.workers:
            procs[f"worker-{w.index}"] = start_worker(info, w, daemon_memory, worker_conf)
        write_state(info)

        wait_registered(info, deadline, procs, logs)
        timings["workers_registered"] = time.monotonic() - t0
    except BaseException:
        with contextlib.suppress(Exception):
            stop_cluster(info, remove_state_dir=False)
        raise
    info.startup_seconds = round(time.monotonic() - t0, 3)
    info.timings = {k: round(v, 3) for k, v in timings.items()}
    write_state(info)
    return info


def restart_lost_workers(info: ClusterInfo, timeout: float = 90.0, daemon_memory: str = "256m") -> list[int]:
    """Start again every Worker whose daemon is gone (a test killed it) or stopped (a test froze it:
    the Master lists it ALIVE until its timeout), or that the Master does not list as ALIVE (still
    dying of its SIGKILL, or given up on while frozen: either would leave the next run one host
    short), on the same host; wait until all are registered. What was left in its netns is SIGKILLed.

    Returns the indexes of the Workers started again.
    """
    status = fetch_master_json(info.master_ui_url)
    alive = {w.get("host") for w in (status or {}).get("workers", []) if w.get("state") == "ALIVE"}
    lost = [w for w in info.workers if not w.serving or (status is not None and w.host not in alive)]
    # Taken before any restart: the ids the lost Workers registered under, which must not count.
    replaced = registered_worker_ids(info, {w.host for w in lost}) if lost else frozenset()
    restarted = []
    for w in lost:
        if is_spark_daemon(w.pid):  # still there, not serving: it goes first (never a recycled PID)
            with contextlib.suppress(OSError):
                os.kill(w.pid, 9)
        deadline = time.monotonic() + 15
        while is_alive(w.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if w.netns:
            for pid in netns_pids(w.netns):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
        start_worker(info, w, daemon_memory, info.worker_conf)
        restarted.append(w.index)
    if restarted:
        write_state(info)
        wait_registered(info, time.monotonic() + timeout, {}, {}, replaced)
    return restarted


def _clean_stale(prefix: str, netns: bool) -> None:
    """Stop a crashed run's leftovers for this prefix; refuse if a live cluster still owns the prefix."""
    reg = registry_file(prefix)
    if reg.exists():
        try:
            old = ClusterInfo.load(json.loads(reg.read_text())["state_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            old = None
        if old is not None:
            if is_spark_daemon(old.master_pid):
                raise ClusterError(
                    f"a cluster with prefix {prefix!r} is running ({old.master_url}, state {old.state_dir}); "
                    f"stop it with `python -m tests.cluster down --prefix {prefix}` or use another prefix"
                )
            stop_cluster(old, remove_state_dir=False)
        reg.unlink(missing_ok=True)
    if netns or leftover_network(prefix):
        cleanup_network(prefix)


def stop_cluster(
    info: ClusterInfo | str | os.PathLike[str], grace: float = 5.0, remove_state_dir: bool | None = None
) -> None:
    """Stop every process the cluster started and remove its namespaces/devices.

    Args:
        info: a ClusterInfo or a state dir containing ``state.json``.
        grace: seconds between SIGTERM and SIGKILL.
        remove_state_dir: delete the state dir afterwards; default: only if start_cluster created it.

    Raises:
        ClusterError: if any of its processes or network devices survive.
    """
    if not isinstance(info, ClusterInfo):
        info = ClusterInfo.load(info)
    survivors = stop_daemons(info, grace)
    if info.netns:
        cleanup_network(info.prefix)
    if survivors:
        details = ", ".join(f"{p} ({command_line(p)[:80]})" for p in survivors)
        raise ClusterError(f"processes survived SIGKILL: {details}")
    unregister(info)
    if remove_state_dir if remove_state_dir is not None else info.owns_state_dir:
        shutil.rmtree(info.state_dir, ignore_errors=True)


def cluster_status(info: ClusterInfo) -> dict[str, Any]:
    """Liveness of the cluster: daemon PIDs, all member processes and the master's JSON status."""
    master = fetch_master_json(info.master_ui_url) if info.master_ui_url else None
    return {
        "master_url": info.master_url,
        "master_ui_url": info.master_ui_url,
        "daemons_alive": {str(pid): is_alive(pid) for pid in info.pids if pid},
        "processes": sorted(cluster_processes(info)),
        "alive_workers": None if master is None else master.get("aliveworkers"),
        "workers": None
        if master is None
        else [
            {k: w.get(k) for k in ("host", "port", "state", "cores", "coresused", "memory")}
            for w in master.get("workers", [])
        ],
        "active_apps": None if master is None else len(master.get("activeapps", [])),
        "netns": info.netns_names,
    }


@contextlib.contextmanager
def spark_cluster(**kwargs: Any) -> Iterator[ClusterInfo]:
    """Context manager around :func:`start_cluster` / :func:`stop_cluster` (same keyword arguments)."""
    info = start_cluster(**kwargs)
    try:
        yield info
    finally:
        stop_cluster(info)
