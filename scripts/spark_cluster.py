#!/usr/bin/env python
"""Start and stop a throw-away Spark standalone cluster for tests and local runs.

The cluster is built from the installed ``pyspark`` (``bin/spark-class``), so no separate Spark
distribution is needed.  Two layouts are supported:

* **loopback** (default): the Master and every Worker bind to ``127.0.0.1`` on free ports.
* **netns** (``--netns``, root only): a Linux bridge ``<prefix>br0`` carrying ``<subnet>.1/24`` is
  created in the root namespace and every Worker runs in its own network namespace
  ``<prefix>-w<N>`` with address ``<subnet>.<10+N>``, connected to the bridge by a veth pair.  The
  Master and the Spark driver run in the root namespace on the bridge address, so each Worker and
  its executors really are on a different "host" as far as Spark (and torch.distributed) can tell.

Every daemon is started in a new session (``start_new_session=True``), so its session id equals its
PID; ``down`` stops everything in those sessions (executors, PySpark daemons and anything they
spawned), plus whatever is still inside the namespaces, then removes the network devices.

CLI::

    python scripts/spark_cluster.py up --workers 2 --cores 1 --memory 1g --netns
    python scripts/spark_cluster.py status
    python scripts/spark_cluster.py down

Python::

    from spark_cluster import spark_cluster
    with spark_cluster(workers=2, cores=1, netns=True) as info:
        subprocess.run([info.spark_submit, *info.spark_submit_args(), "app.py"], env=info.driver_env())
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_PREFIX = "td"
DEFAULT_SUBNET = "10.231.0"
STATE_FILE = "state.json"
# Pointer files (prefix -> state dir) so `status` / `down` find a cluster started by an earlier `up`.
REGISTRY_DIR = Path(tempfile.gettempdir()) / "torchdist-spark-clusters"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_SUBNET_RE = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")


class ClusterError(RuntimeError):
    """Raised when the cluster cannot be started, reached or fully stopped."""


@dataclasses.dataclass
class WorkerInfo:
    """One Spark Worker daemon."""

    index: int  #: 1-based worker number
    host: str  #: address the Worker (and its executors) bind to and advertise
    pid: int  #: PID of the daemon (also its session id and process group id)
    log: str  #: stdout/stderr of the daemon
    work_dir: str  #: SPARK_WORKER_DIR (executor stdout/stderr end up in here)
    netns: str | None = None  #: network namespace it runs in, if any
    host_veth: str | None = None  #: root-namespace end of its veth pair, if any


@dataclasses.dataclass
class ClusterInfo:
    """Everything needed to use, inspect and stop a running cluster (also the state-file schema)."""

    master_url: str  #: spark://host:port
    master_ui_url: str  #: http://host:port (JSON status at <url>/json/)
    master_host: str
    master_port: int
    master_ui_port: int
    master_pid: int
    master_log: str
    driver_host: str  #: address a driver in the root namespace must bind to / advertise
    workers: list[WorkerInfo]
    cores: int  #: cores per worker
    memory: str  #: memory per worker (what executors on it may use in total)
    netns: bool
    prefix: str
    subnet: str | None
    bridge: str | None  #: bridge device created for --netns
    state_dir: str
    spark_home: str
    python: str  #: interpreter PySpark uses on driver and executors
    startup_seconds: float = 0.0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    owns_state_dir: bool = False  #: the state dir is a temp dir created by start_cluster

    @property
    def worker_hosts(self) -> list[str]:
        """Addresses of the workers, in worker order."""
        return [w.host for w in self.workers]

    @property
    def netns_names(self) -> list[str]:
        """Network namespaces created for the workers (empty without --netns)."""
        return [w.netns for w in self.workers if w.netns]

    @property
    def pids(self) -> list[int]:
        """PIDs (= session ids) of the daemons started by this cluster."""
        # 0 = not started yet; never treat it as a session id (kernel threads have sid 0).
        return [pid for pid in (self.master_pid, *(w.pid for w in self.workers)) if pid > 0]

    @property
    def spark_submit(self) -> str:
        """Path of the ``spark-submit`` belonging to the cluster's Spark."""
        return str(Path(self.spark_home) / "bin" / "spark-submit")

    def spark_conf(self) -> dict[str, str]:
        """Spark settings a client-mode driver in the root namespace needs to use this cluster."""
        return {
            "spark.master": self.master_url,
            # Executors in the namespaces can only reach the driver on the bridge address, and the
            # driver must not listen on the machine's real interfaces.
            "spark.driver.host": self.driver_host,
            "spark.driver.bindAddress": self.driver_host,
            "spark.pyspark.python": self.python,
            "spark.pyspark.driver.python": self.python,
        }

    def spark_submit_args(self, extra_conf: dict[str, str] | None = None) -> list[str]:
        """``--master``/``--conf`` arguments for ``spark-submit`` (client mode)."""
        conf = self.spark_conf()
        master = conf.pop("spark.master")
        conf.update(extra_conf or {})
        args = ["--master", master, "--deploy-mode", "client"]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        return args

    def driver_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a driver process: its web UI (and any other listener) stays on driver_host."""
        env = dict(os.environ if base is None else base)
        env.update(
            SPARK_HOME=self.spark_home,
            SPARK_LOCAL_IP=self.driver_host,
            SPARK_LOCAL_HOSTNAME=self.driver_host,
            PYSPARK_PYTHON=self.python,
            PYSPARK_DRIVER_PYTHON=self.python,
        )
        return env

    def to_json(self) -> str:
        """Serialise to the state-file JSON."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterInfo:
        """Inverse of :meth:`to_json` (after ``json.loads``)."""
        data = dict(data)
        data["workers"] = [WorkerInfo(**w) for w in data["workers"]]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> ClusterInfo:
        """Read ``state.json`` from a state dir."""
        return cls.from_dict(json.loads((Path(state_dir) / STATE_FILE).read_text()))


# --------------------------------------------------------------------------------------------------
# helpers


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


def _run(cmd: list[str], *, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _free_port(host: str) -> int:
    """A port that is free on host right now (small race window; the master fails loudly if lost)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, sid) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone (or vanishing while we read)
        return None
    # comm (field 2) may contain spaces/parens: split after its closing parenthesis.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[2]), int(rest[3])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z"


def _reap(pid: int) -> None:
    """Collect a zombie child of this process (a no-op for processes we are not the parent of)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _session_members(sids: set[int]) -> set[int]:
    """Live processes whose session id is in sids."""
    found: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st and st[0] != "Z" and st[2] in sids:
            found.add(int(entry.name))
    return found


def _netns_pids(name: str) -> set[int]:
    proc = _run(["ip", "netns", "pids", name], check=False)
    return {int(p) for p in proc.stdout.split() if p.isdigit()} if proc.returncode == 0 else set()


def _log_tail(path: str | os.PathLike[str], lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _fetch_master_json(ui_url: str, timeout: float = 1.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{ui_url}/json/", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _registry_file(prefix: str) -> Path:
    return REGISTRY_DIR / f"{prefix}.json"


def _validate(prefix: str, subnet: str) -> None:
    if not _PREFIX_RE.match(prefix):
        # Interface names are limited to 15 chars: "<prefix>w<NN>h" must fit.
        raise ClusterError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    m = _SUBNET_RE.match(subnet)
    if not m or not all(0 <= int(g) <= 255 for g in m.groups()):
        raise ClusterError(f"subnet {subnet!r} must look like '10.231.0' (a /24 prefix)")
    first = int(m.group(1))
    second = int(m.group(2))
    if not (first == 10 or (first == 172 and 16 <= second <= 31) or (first == 192 and second == 168)):
        raise ClusterError(f"subnet {subnet!r} is not a private (RFC 1918) range")


def _names(prefix: str, index: int) -> tuple[str, str, str]:
    """(namespace, host-side veth, namespace-side veth) of worker `index`."""
    return f"{prefix}-w{index}", f"{prefix}w{index}h", f"{prefix}w{index}n"


# --------------------------------------------------------------------------------------------------
# network namespaces


def _setup_network(prefix: str, subnet: str, workers: int) -> None:
    bridge = f"{prefix}br0"
    for i in range(1, workers + 1):
        _run(["ip", "netns", "add", _names(prefix, i)[0]])
    # `ip -batch` keeps this to a few processes, and stops at (and reports) the first failing line.
    lines = [
        f"link add {bridge} type bridge",
        f"addr add {subnet}.1/24 dev {bridge}",
        f"link set {bridge} up",
    ]
    for i in range(1, workers + 1):
        ns, host_veth, ns_veth = _names(prefix, i)
        lines += [
            f"link add {host_veth} type veth peer name {ns_veth} netns {ns}",
            f"link set {host_veth} master {bridge}",
            f"link set {host_veth} up",
        ]
    _run(["ip", "-batch", "-"], stdin="\n".join(lines) + "\n")
    for i in range(1, workers + 1):
        ns, _, ns_veth = _names(prefix, i)
        ns_lines = [
            f"addr add {subnet}.{10 + i}/24 dev {ns_veth}",
            f"link set {ns_veth} up",
            # The PySpark daemon and its python workers talk to their executor over 127.0.0.1.
            "link set lo up",
        ]
        _run(["ip", "-n", ns, "-batch", "-"], stdin="\n".join(ns_lines) + "\n")


def _cleanup_network(prefix: str, max_workers: int | None = None) -> None:
    """Remove every namespace / veth / bridge with this prefix (idempotent); kill what runs inside."""
    ns_re = re.compile(rf"^{re.escape(prefix)}-w\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}(w\d+[hn]|br0)$")
    namespaces = [
        line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line
    ]
    namespaces = [n for n in namespaces if ns_re.match(n)]
    pids: set[int] = set()
    for ns in namespaces:
        pids |= _netns_pids(ns)
    _kill(pids, grace=5.0)
    links = []
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if link_re.match(name):
                links.append(name)
    # Delete host-side veths explicitly: the kernel removes a veth with its namespace only lazily.
    batch = [f"link del {name}" for name in sorted(links, key=lambda n: n.endswith("br0"))]
    batch += [f"netns del {ns}" for ns in namespaces]
    if batch:
        _run(["ip", "-force", "-batch", "-"], stdin="\n".join(batch) + "\n", check=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not leftover_network(prefix):
            return
        time.sleep(0.1)
    raise ClusterError(f"network devices/namespaces still present after cleanup: {leftover_network(prefix)}")


def leftover_network(prefix: str) -> list[str]:
    """Namespaces and network devices with this prefix that still exist (empty when clean)."""
    ns_re = re.compile(rf"^{re.escape(prefix)}-w\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}(w\d+[hn]|br0)$")
    out = [
        n.split()[0]
        for n in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
        if n and ns_re.match(n.split()[0])
    ]
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2 and link_re.match(parts[1].strip().split("@")[0]):
            out.append(parts[1].strip().split("@")[0])
    return out


_PROBE_CONNECT = (
    "import socket,sys\n"
    "try:\n"
    "    c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=float(sys.argv[3]))\n"
    "    print(c.getsockname()[0])\n"
    "except OSError as e:\n"
    "    sys.exit(f'connect {sys.argv[1]}:{sys.argv[2]}: {e}')\n"
)
_PROBE_LISTEN = (
    "import socket,sys\n"
    "s=socket.socket();s.bind((sys.argv[1],0));s.listen(16);s.settimeout(float(sys.argv[3]))\n"
    "print(s.getsockname()[1],flush=True)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    c,a=s.accept();print(a[0],flush=True);c.close()\n"
)


def _probe(netns: str, python: str, code: str, *args: object) -> subprocess.Popen[str]:
    """Run a tiny isolated python snippet inside a namespace (stdout/stderr captured)."""
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, python, "-I", "-S", "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_netns_connectivity(info: ClusterInfo, timeout: float = 5.0) -> None:
    """Prove TCP works root->ns, ns->root and ns->ns (all workers to worker 1); raise ClusterError if not.

    Executors must reach the driver on the bridge address, the driver/master must reach the workers,
    and torch.distributed ranks in different namespaces must reach rank 0.
    """
    if not info.netns:
        return
    w1, others = info.workers[0], info.workers[1:]
    # Listeners: the root namespace (driver side) in-process, worker 1's namespace (rank 0 side).
    root = socket.socket()
    root.bind((info.driver_host, 0))
    root.listen(len(info.workers) + 1)
    root.settimeout(timeout)
    root_port = root.getsockname()[1]
    listener = _probe(w1.netns, info.python, _PROBE_LISTEN, w1.host, len(others) + 1, timeout)
    connectors: list[tuple[str, str, subprocess.Popen[str]]] = []
    try:
        for w in info.workers:
            proc = _probe(w.netns, info.python, _PROBE_CONNECT, info.driver_host, root_port, timeout)
            connectors.append((f"{w.netns} -> root {info.driver_host}", w.host, proc))
        port_line = listener.stdout.readline().strip() if listener.stdout else ""
        if not port_line.isdigit():
            err = listener.stderr.read() if listener.stderr else ""
            raise ClusterError(f"probe listener in {w1.netns} failed: {err.strip()}")
        w1_port = int(port_line)
        for w in others:
            proc = _probe(w.netns, info.python, _PROBE_CONNECT, w1.host, w1_port, timeout)
            connectors.append((f"{w.netns} -> {w1.netns} {w1.host}", w.host, proc))
        failures = []
        try:
            with socket.create_connection((w1.host, w1_port), timeout=timeout):
                pass
        except OSError as exc:
            failures.append(f"root -> {w1.netns} {w1.host}:{w1_port}: {exc}")
        for label, expect_src, proc in connectors:
            out, err = proc.communicate(timeout=timeout + 5)
            if proc.returncode != 0:
                failures.append(f"{label}: {err.strip() or out.strip()}")
            elif out.strip() != expect_src:
                # e.g. a route through another interface: the executor would advertise the wrong IP
                failures.append(f"{label}: connected from {out.strip()}, expected source {expect_src}")
        for _ in info.workers:
            try:
                root.accept()[0].close()
            except OSError as exc:
                failures.append(f"root listener on {info.driver_host}:{root_port}: {exc}")
                break
        if failures:
            raise ClusterError("network namespace connectivity check failed:\n  " + "\n  ".join(failures))
    finally:
        root.close()
        for proc in [listener, *(c[2] for c in connectors)]:
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=timeout if proc is listener else 0.1)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# --------------------------------------------------------------------------------------------------
# processes


def _kill(pids: set[int], grace: float) -> set[int]:
    """SIGTERM pids, SIGKILL whatever is left after `grace` seconds; return survivors (normally none)."""
    pids = {p for p in pids if pid_alive(p)}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                _reap(pid)
                if not pid_alive(pid):
                    pids.discard(pid)
            time.sleep(0.05)
        if not pids:
            break
    return pids


def _our_sessions(info: ClusterInfo) -> set[int]:
    """Session ids that still belong to this cluster.

    A daemon's session id is its PID.  If the daemon is gone, any remaining member of its session is
    one of its descendants (the kernel does not reuse a PID that is still a session id).  If a process
    with that PID is alive it must still look like Spark, so a recycled PID is never touched.
    """
    sids = set()
    for pid in info.pids:
        if not pid_alive(pid) or "spark" in _cmdline(pid).lower():
            sids.add(pid)
    return sids


def cluster_processes(info: ClusterInfo) -> set[int]:
    """Live processes belonging to the cluster: its daemons' sessions plus anything in its namespaces."""
    pids = _session_members(_our_sessions(info))
    for ns in info.netns_names:
        pids |= _netns_pids(ns)
    return pids


def _daemon_env(
    python: str, spark_home: str, host: str, conf_dir: Path, local_dir: Path, daemon_memory: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(
        SPARK_HOME=spark_home,
        SPARK_CONF_DIR=str(conf_dir),  # isolate from any user spark-defaults.conf / spark-env.sh
        # Bind (RPC, web UI, block manager of executors) and advertise this address only.
        SPARK_LOCAL_IP=host,
        SPARK_LOCAL_HOSTNAME=host,
        SPARK_LOCAL_DIRS=str(local_dir),
        SPARK_DAEMON_MEMORY=daemon_memory,
        # Master/Worker do little work: C1-only JIT and serial GC spend far less CPU booting (`up` went
        # from ~9 s to ~5 s on 2 cores).  Executors do not inherit these options.
        SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=1",
        PYSPARK_PYTHON=python,
        PYSPARK_DRIVER_PYTHON=python,
    )
    return env


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        # New session: the daemon leads its own session/process group, so we can find and stop all it
        # spawns, and it survives the `up` CLI exiting.
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )


def _wait_master_alive(
    info: ClusterInfo, deadline: float, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str]
) -> None:
    """Wait until the Master reports status ALIVE (it is leader and accepts Worker registrations).

    An open RPC port is not enough: the Master binds it seconds before it is elected leader, and a
    Worker registering in between is told "standby" and retries only after 5-15 s.
    """
    while True:
        _check_procs(procs, logs)
        status = _fetch_master_json(info.master_ui_url)
        if status is not None and status.get("status") == "ALIVE":
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"master at {info.master_url} not ALIVE in time (UI {info.master_ui_url}/json/: "
                f"{status and status.get('status')}); log:\n{_log_tail(logs['master'])}"
            )
        time.sleep(0.05)


def _check_procs(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str]) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise ClusterError(
                f"{name} exited with {proc.returncode} during start-up; log {logs[name]}:\n"
                f"{_log_tail(logs[name])}"
            )


# --------------------------------------------------------------------------------------------------
# public API


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
    _validate(prefix, subnet)
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
    )
    for i in range(1, workers + 1):
        ns, host_veth, _ = _names(prefix, i)
        wdir = sdir / f"worker-{i}"
        info.workers.append(
            WorkerInfo(
                index=i,
                host=f"{subnet}.{10 + i}" if netns else "127.0.0.1",
                pid=0,
                log=str(sdir / f"worker-{i}.log"),
                work_dir=str(wdir / "work"),
                netns=ns if netns else None,
                host_veth=host_veth if netns else None,
            )
        )

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {"master": info.master_log, **{f"worker-{w.index}": w.log for w in info.workers}}
    try:
        if netns:
            t = time.monotonic()
            _setup_network(prefix, subnet, workers)
            timings["network_setup"] = time.monotonic() - t
        # Early, so `down` (and the next `up`) find the daemons even if this process dies half-way.
        _write_state(info)
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        _registry_file(prefix).write_text(json.dumps({"state_dir": str(sdir)}))

        spark_class = str(Path(spark_home) / "bin" / "spark-class")
        info.master_port = _free_port(host)
        info.master_ui_port = _free_port(host)
        info.master_url = f"spark://{host}:{info.master_port}"
        info.master_ui_url = f"http://{host}:{info.master_ui_port}"
        (sdir / "master-local").mkdir(exist_ok=True)
        master_env = _daemon_env(
            python, spark_home, host, sdir / "conf", sdir / "master-local", daemon_memory
        )
        # The REST submission server would listen on 6066 of all interfaces; it is not needed.
        master_env["SPARK_MASTER_OPTS"] = "-Dspark.master.rest.enabled=false"
        procs["master"] = _spawn(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                host,
                "--port",
                str(info.master_port),
                "--webui-port",
                str(info.master_ui_port),
            ],
            master_env,
            Path(info.master_log),
            sdir,
        )
        info.master_pid = procs["master"].pid
        _write_state(info)

        if netns:
            # Runs while the Master JVM boots, before any Worker starts: a broken bridge/veth then
            # fails here with a precise message instead of as a registration timeout.
            t = time.monotonic()
            check_netns_connectivity(info)
            timings["connectivity_check"] = time.monotonic() - t

        deadline = time.monotonic() + timeout
        if not parallel_start:
            _wait_master_alive(info, deadline, procs, logs)
            timings["master_alive"] = time.monotonic() - t0
        for w in info.workers:
            wdir = Path(w.work_dir).parent
            (wdir / "local").mkdir(parents=True, exist_ok=True)
            Path(w.work_dir).mkdir(parents=True, exist_ok=True)
            env = _daemon_env(python, spark_home, w.host, sdir / "conf", wdir / "local", daemon_memory)
            if worker_conf:
                env["SPARK_WORKER_OPTS"] = " ".join(f"-D{k}={v}" for k, v in worker_conf.items())
            cmd = [
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                info.master_url,
                "--host",
                w.host,
                # port 0: the OS picks; Workers report their real ports to the master.
                "--port",
                "0",
                "--webui-port",
                "0",
                "--cores",
                str(cores),
                "--memory",
                memory,
                "--work-dir",
                w.work_dir,
            ]
            if w.netns:
                cmd = ["ip", "netns", "exec", w.netns, *cmd]  # `ip netns exec` execs: PID stays the same
            procs[f"worker-{w.index}"] = _spawn(cmd, env, Path(w.log), sdir)
            w.pid = procs[f"worker-{w.index}"].pid
        _write_state(info)

        _wait_registered(info, deadline, procs, logs)
        timings["workers_registered"] = time.monotonic() - t0
    except BaseException:
        with contextlib.suppress(Exception):
            stop_cluster(info, remove_state_dir=False)
        raise
    info.startup_seconds = round(time.monotonic() - t0, 3)
    info.timings = {k: round(v, 3) for k, v in timings.items()}
    _write_state(info)
    return info


def _wait_registered(
    info: ClusterInfo, deadline: float, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str]
) -> None:
    want = sorted(info.worker_hosts)
    seen: list[str] = []
    while True:
        _check_procs(procs, logs)
        status = _fetch_master_json(info.master_ui_url)
        if status is not None:
            seen = sorted(w["host"] for w in status.get("workers", []) if w.get("state") == "ALIVE")
            if seen == want:
                return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {name} ({path}):\n{_log_tail(path, 10)}" for name, path in logs.items())
            raise ClusterError(
                f"only {len(seen)}/{len(want)} workers registered with {info.master_url} "
                f"(alive: {seen}, expected: {want}); master UI {info.master_ui_url}/json/ "
                f"{'answered' if status is not None else 'did not answer'}.\n{tails}"
            )
        time.sleep(0.1)


def _write_state(info: ClusterInfo) -> None:
    path = Path(info.state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.to_json())
    tmp.replace(path)


def _clean_stale(prefix: str, netns: bool) -> None:
    """Stop a crashed run's leftovers for this prefix; refuse if a live cluster still owns the prefix."""
    reg = _registry_file(prefix)
    if reg.exists():
        try:
            old = ClusterInfo.load(json.loads(reg.read_text())["state_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            old = None
        if old is not None:
            if pid_alive(old.master_pid) and "spark" in _cmdline(old.master_pid).lower():
                raise ClusterError(
                    f"a cluster with prefix {prefix!r} is running ({old.master_url}, state {old.state_dir}); "
                    f"stop it with `spark_cluster.py down --prefix {prefix}` or use another prefix"
                )
            stop_cluster(old, remove_state_dir=False)
        reg.unlink(missing_ok=True)
    if netns or leftover_network(prefix):
        _cleanup_network(prefix)


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
    survivors = _kill(cluster_processes(info), grace)
    # Second sweep: a process may have forked while the first signals were on their way.
    survivors |= _kill(cluster_processes(info), grace=2.0)
    for pid in info.pids:
        if pid:
            _reap(pid)
    if info.netns:
        _cleanup_network(info.prefix)
    if survivors:
        details = ", ".join(f"{p} ({_cmdline(p)[:80]})" for p in sorted(survivors))
        raise ClusterError(f"processes survived SIGKILL: {details}")
    reg = _registry_file(info.prefix)
    with contextlib.suppress(OSError, ValueError, KeyError):
        if Path(json.loads(reg.read_text())["state_dir"]).resolve() == Path(info.state_dir).resolve():
            reg.unlink()
    if remove_state_dir if remove_state_dir is not None else info.owns_state_dir:
        shutil.rmtree(info.state_dir, ignore_errors=True)


def cluster_status(info: ClusterInfo) -> dict[str, Any]:
    """Liveness of the cluster: daemon PIDs, all member processes and the master's JSON status."""
    master = _fetch_master_json(info.master_ui_url) if info.master_ui_url else None
    return {
        "master_url": info.master_url,
        "master_ui_url": info.master_ui_url,
        "daemons_alive": {str(pid): pid_alive(pid) for pid in info.pids if pid},
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


class SparkCluster:
    """Object wrapper for fixtures: ``cluster = SparkCluster(workers=2, netns=True); cluster.start()``.

    Also usable as ``with SparkCluster(...) as info:``.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.info: ClusterInfo | None = None

    def start(self) -> ClusterInfo:
        """Start the cluster (see :func:`start_cluster`)."""
        if self.info is not None:
            raise ClusterError("cluster already started")
        self.info = start_cluster(**self.kwargs)
        return self.info

    def stop(self) -> None:
        """Stop the cluster if it is running."""
        if self.info is not None:
            info, self.info = self.info, None
            stop_cluster(info)

    def __enter__(self) -> ClusterInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------------
# CLI


def _resolve_state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir:
        return Path(args.state_dir)
    reg = _registry_file(args.prefix)
    if reg.exists():
        return Path(json.loads(reg.read_text())["state_dir"])
    return Path(tempfile.gettempdir()) / f"torchdist-spark-{args.prefix}"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``up``, ``down`` or ``status``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cores", type=int, default=1, help="cores per worker")
    parser.add_argument("--memory", default="1g", help="memory per worker, e.g. 2g")
    parser.add_argument("--netns", action="store_true", help="one network namespace per worker (root)")
    parser.add_argument("--state-dir", help="default: $TMPDIR/torchdist-spark-<prefix>")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace/device name prefix")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help="/24 for --netns, e.g. 10.231.0")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="boot Worker JVMs together with the Master (may cost a 5-15 s registration retry)",
    )
    args = parser.parse_args(argv)

    if args.action == "up":
        state_dir = Path(args.state_dir or Path(tempfile.gettempdir()) / f"torchdist-spark-{args.prefix}")
        info = start_cluster(
            workers=args.workers,
            cores=args.cores,
            memory=args.memory,
            netns=args.netns,
            state_dir=state_dir,
            prefix=args.prefix,
            subnet=args.subnet,
            timeout=args.timeout,
            parallel_start=args.parallel,
        )
        print(f"master:  {info.master_url}")
        print(f"ui:      {info.master_ui_url}")
        print(
            f"driver:  --conf spark.driver.host={info.driver_host} --conf spark.driver.bindAddress={info.driver_host}"
        )
        print(
            f"workers: {', '.join(f'{w.host}' + (f' ({w.netns})' if w.netns else '') for w in info.workers)}"
        )
        print(f"state:   {info.state_dir}/{STATE_FILE}")
        print(f"up in {info.startup_seconds:.2f}s {info.timings}")
        return 0

    state_dir = _resolve_state_dir(args)
    if not (state_dir / STATE_FILE).exists():
        if args.action == "down":
            # Nothing recorded; still remove namespaces/devices a crashed run may have left behind.
            _cleanup_network(args.prefix)
            print(f"no state in {state_dir}; removed stale network devices for prefix {args.prefix!r} if any")
            return 0
        print(f"no cluster state in {state_dir}", file=sys.stderr)
        return 1
    info = ClusterInfo.load(state_dir)
    if args.action == "status":
        print(json.dumps(cluster_status(info), indent=2))
        return 0
    t = time.monotonic()
    stop_cluster(info, remove_state_dir=False)
    print(
        f"stopped {info.master_url} in {time.monotonic() - t:.2f}s; no processes left; state kept in {state_dir}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
