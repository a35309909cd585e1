"""The Spark standalone daemons: start the Master and the Workers, watch them come up, end them.

Every daemon is started by :func:`~airflow_provider_torchdist.supervision.processes.start_detached`, in a session
of its own whose id is its PID, so the daemon, its executors, the PySpark daemon and anything they
spawn are found (and ended) by that PID alone, even after the process that started them is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.node.network import free_port
from airflow_provider_torchdist.supervision.processes import (
    command_line,
    end_processes,
    is_alive,
    session_members,
    start_detached,
)
from tests.cluster.netns import netns_pids
from tests.cluster.state import ClusterError, ClusterInfo, WorkerInfo


def find_spark_home() -> str:
    """SPARK_HOME of the installed pyspark (it ships bin/spark-class and the jars)."""
    try:
        from pyspark.find_spark_home import _find_spark_home

        home = _find_spark_home()
    except Exception:  # an old/odd pyspark layout: fall back to the package dir
        import pyspark

        home = os.path.dirname(pyspark.__file__)
    if not (Path(home) / "bin" / "spark-class").exists():
        raise ClusterError(f"no bin/spark-class under SPARK_HOME={home}; is the full pyspark installed?")
    return str(home)


def _daemon_env(info: ClusterInfo, host: str, local_dir: Path, daemon_memory: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(
        SPARK_HOME=info.spark_home,
        # Isolate from any user spark-defaults.conf / spark-env.sh.
        SPARK_CONF_DIR=str(Path(info.state_dir) / "conf"),
        # Bind (RPC, web UI, block manager of executors) and advertise this address only.
        SPARK_LOCAL_IP=host,
        SPARK_LOCAL_HOSTNAME=host,
        SPARK_LOCAL_DIRS=str(local_dir),
        SPARK_DAEMON_MEMORY=daemon_memory,
        # Master/Worker do little work: C1-only JIT and serial GC spend far less CPU booting (`up` went
        # from ~9 s to ~5 s on 2 cores).  Executors do not inherit these options.
        SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=1",
        PYSPARK_PYTHON=info.python,
        PYSPARK_DRIVER_PYTHON=info.python,
    )
    return env


def _spark_class(info: ClusterInfo) -> str:
    return str(Path(info.spark_home) / "bin" / "spark-class")


def start_master(info: ClusterInfo, daemon_memory: str) -> subprocess.Popen[bytes]:
    """Pick free ports on ``info.master_host``, record them and the PID in ``info``, start the Master."""
    host, sdir = info.master_host, Path(info.state_dir)
    info.master_port = free_port(host)
    info.master_ui_port = free_port(host)
    info.master_url = f"spark://{host}:{info.master_port}"
    info.master_ui_url = f"http://{host}:{info.master_ui_port}"
    (sdir / "master-local").mkdir(exist_ok=True)
    env = _daemon_env(info, host, sdir / "master-local", daemon_memory)
    # The REST submission server would listen on 6066 of all interfaces; it is not needed.
    env["SPARK_MASTER_OPTS"] = "-Dspark.master.rest.enabled=false"
    cmd = [
        _spark_class(info),
        "org.apache.spark.deploy.master.Master",
        "--host",
        host,
        "--port",
        str(info.master_port),
        "--webui-port",
        str(info.master_ui_port),
    ]
    proc = start_detached(cmd, env=env, log=info.master_log, cwd=sdir)
    info.master_pid = proc.pid
    return proc


def start_worker(
    info: ClusterInfo, worker: WorkerInfo, daemon_memory: str, worker_conf: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """Start one Worker (inside its namespace, if it has one) and record its PID in ``worker``."""
    wdir = Path(worker.work_dir).parent
    (wdir / "local").mkdir(parents=True, exist_ok=True)
    Path(worker.work_dir).mkdir(parents=True, exist_ok=True)
    env = _daemon_env(info, worker.host, wdir / "local", daemon_memory)
    if worker_conf:
        env["SPARK_WORKER_OPTS"] = " ".join(f"-D{k}={v}" for k, v in worker_conf.items())
    cmd = [
        _spark_class(info),
        "org.apache.spark.deploy.worker.Worker",
        info.master_url,
        "--host",
        worker.host,
        # port 0: the OS picks; Workers report their real ports to the master.
        "--port",
        "0",
        "--webui-port",
        "0",
        "--cores",
        str(info.cores),
        "--memory",
        info.memory,
        "--work-dir",
        worker.work_dir,
    ]
    if worker.netns:
        cmd = ["ip", "netns", "exec", worker.netns, *cmd]  # `ip netns exec` execs: PID stays the same
    proc = start_detached(cmd, env=env, log=worker.log, cwd=info.state_dir)
    worker.pid = proc.pid
    return proc


def fetch_master_json(ui_url: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The Master's JSON status (``<ui>/json/``), or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"{ui_url}/json/", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def log_tail(path: str | os.PathLike[str], lines: int = 25) -> str:
    """The last ``lines`` lines of a daemon's log."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check_procs(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str]) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise ClusterError(
                f"{name} exited with {proc.returncode} during start-up; log {logs[name]}:\n{log_tail(logs[name])}"
            )


def wait_master_alive(
    info: ClusterInfo, deadline: float, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str]
) -> None:
    """Wait until the Master reports status ALIVE (it is leader and accepts Worker registrations).

    An open RPC port is not enough: the Master binds it seconds before it is elected leader, and a
    Worker registering in between is told "standby" and retries only after 5-15 s.
    """
    while True:
        _check_procs(procs, logs)
        status = fetch_master_json(info.master_ui_url)
        if status is not None and status.get("status") == "ALIVE":
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"master at {info.master_url} not ALIVE in time (UI {info.master_ui_url}/json/: "
                f"{status and status.get('status')}); log:\n{log_tail(logs['master'])}"
            )
        time.sleep(0.05)


def wait_registered(
    info: ClusterInfo,
    deadline: float,
    procs: dict[str, subprocess.Popen[bytes]],
    logs: dict[str, str],
    replaced: frozenset[str] = frozenset(),
) -> None:
    """Wait until every Worker is registered with the Master and ALIVE.

    ``replaced``: the ids of Workers that were lost and started again. The Master may still list a
    lost Worker as ALIVE for a moment after its JVM died; counting it would let the wait return before
    its replacement registered, and the next run would find one host's slots missing. So those ids
    must be gone from the ALIVE list, and a new id must stand for their host.
    """
    want = sorted(info.worker_hosts)
    seen: list[str] = []
    while True:
        _check_procs(procs, logs)
        status = fetch_master_json(info.master_ui_url)
        if status is not None:
            alive = [w for w in status.get("workers", []) if w.get("state") == "ALIVE"]
            seen = sorted(w["host"] for w in alive if w.get("id") not in replaced)
            if seen == want and not any(w.get("id") in replaced for w in alive):
                return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {name} ({path}):\n{log_tail(path, 10)}" for name, path in logs.items())
            raise ClusterError(
                f"only {len(seen)}/{len(want)} workers registered with {info.master_url} "
                f"(alive: {seen}, expected: {want}); master UI {info.master_ui_url}/json/ "
                f"{'answered' if status is not None else 'did not answer'}.\n{tails}"
            )
        time.sleep(0.1)


def cluster_logs(info: ClusterInfo, lines: int = 12) -> str:
    """The ends of the Master's and each Worker's log, and of the newest executor's stderr on each
    Worker: what a test failing on the cluster's state shows."""
    parts = [f"--- master ({info.master_log}):\n{log_tail(info.master_log, lines)}"]
    for w in info.workers:
        parts.append(f"--- worker {w.index} on {w.host} ({w.log}):\n{log_tail(w.log, lines)}")
        executors = sorted(Path(w.work_dir).glob("app-*/*/stderr"), key=lambda f: f.stat().st_mtime)
        if executors:
            parts.append(f"--- newest executor stderr ({executors[-1]}):\n{log_tail(executors[-1], lines)}")
    return "\n".join(parts)


def wait_idle(info: ClusterInfo, timeout: float = 60.0) -> None:
    """Wait until the Master runs no application and lists every Worker ALIVE with all its cores
    free, and no Worker daemon is stopped or a zombie: what an earlier run held (an application
    still being removed, an executor still being killed, a frozen host) is back, so the next run
    finds the slots the test counts on. A run that finds a slot held waits for it, and one whose
    connection names the web UI waits as long as it takes.

    Raises :class:`ClusterError` with the Master's view after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        status = fetch_master_json(info.master_ui_url)
        if status is not None:
            alive = [w for w in status.get("workers", []) if w.get("state") == "ALIVE"]
            busy = [w for w in alive if w.get("coresfree") != w.get("cores")]
            whole = sorted(w.get("host") for w in alive) == sorted(info.worker_hosts)
            if whole and not busy and not status.get("activeapps") and all(w.serving for w in info.workers):
                return
        if time.monotonic() > deadline:
            view = status and {
                "workers": [
                    {k: w.get(k) for k in ("host", "state", "cores", "coresfree")}
                    for w in status.get("workers", [])
                ],
                "activeapps": [
                    (a.get("id"), a.get("name"), a.get("state")) for a in status.get("activeapps", [])
                ],
            }
            raise ClusterError(
                f"the cluster at {info.master_url} was not idle after {timeout:.0f} s: {view}\n{cluster_logs(info)}"
            )
        time.sleep(0.2)


def registered_worker_ids(info: ClusterInfo, hosts: set[str]) -> frozenset[str]:
    """The ids the Master lists (in any state) for Workers on ``hosts``."""
    status = fetch_master_json(info.master_ui_url) or {}
    return frozenset(w["id"] for w in status.get("workers", []) if w.get("host") in hosts and "id" in w)


def is_spark_daemon(pid: int) -> bool:
    """Whether ``pid`` is alive and still looks like a Spark daemon (not a recycled PID)."""
    return is_alive(pid) and "spark" in command_line(pid).lower()


def _our_sessions(info: ClusterInfo) -> set[int]:
    """Session ids that still belong to this cluster.

    A daemon's session id is its PID.  If the daemon is gone, any remaining member of its session is
    one of its descendants (the kernel does not reuse a PID that is still a session id).  If a process
    with that PID is alive it must still look like Spark, so a recycled PID is never touched.
    """
    return {pid for pid in info.pids if not is_alive(pid) or is_spark_daemon(pid)}


def cluster_processes(info: ClusterInfo) -> set[int]:
    """Live processes belonging to the cluster: its daemons' sessions plus anything in its namespaces."""
    pids = set(session_members(*_our_sessions(info)))
    for ns in info.netns_names:
        pids |= netns_pids(ns)
    return pids


def stop_daemons(info: ClusterInfo, grace: float) -> list[int]:
    """End every process of the cluster (SIGTERM, ``grace`` seconds, SIGKILL); return survivors."""
    survivors = set(end_processes(cluster_processes(info), grace))
    # Second sweep: a process may have forked while the first signals were on their way.
    survivors |= set(end_processes(cluster_processes(info), grace=2.0))
    for pid in info.pids:
        # Daemons this process started are its children: collect them, so no zombie stays behind.
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    return sorted(survivors)
