"""Test hosts as Linux network namespaces: one per Worker, joined by a bridge in the root namespace.

Worker ``N`` of prefix ``p`` lives in namespace ``p-wN`` with address ``<subnet>.<10+N>/24`` on its
end (``pwNn``) of a veth pair; the other end (``pwNh``) is a port of the bridge ``pbr0``, which
carries ``<subnet>.1/24`` for the Master and the driver. All of it needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time

from airflow_provider_torchdist.supervision.processes import end_processes
from tests.cluster.state import ClusterError, ClusterInfo


def run_ip(
    cmd: list[str], *, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run an ``ip`` command (or any other), raising ClusterError with its stderr when ``check``."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def worker_names(prefix: str, index: int) -> tuple[str, str, str]:
    """(namespace, host-side veth, namespace-side veth) of worker ``index``."""
    return f"{prefix}-w{index}", f"{prefix}w{index}h", f"{prefix}w{index}n"


def netns_pids(name: str) -> set[int]:
    """PIDs of the processes inside namespace ``name`` (empty if it does not exist)."""
    proc = run_ip(["ip", "netns", "pids", name], check=False)
    return {int(p) for p in proc.stdout.split() if p.isdigit()} if proc.returncode == 0 else set()


def setup_network(prefix: str, subnet: str, workers: int) -> None:
    """Create the bridge, one namespace per worker and the veth pairs joining them."""
    bridge = f"{prefix}br0"
    for i in range(1, workers + 1):
        run_ip(["ip", "netns", "add", worker_names(prefix, i)[0]])
    # `ip -batch` keeps this to a few processes, and stops at (and reports) the first failing line.
    lines = [
        f"link add {bridge} type bridge",
        f"addr add {subnet}.1/24 dev {bridge}",
        f"link set {bridge} up",
    ]
    for i in range(1, workers + 1):
        ns, host_veth, ns_veth = worker_names(prefix, i)
        lines += [
            f"link add {host_veth} type veth peer name {ns_veth} netns {ns}",
            f"link set {host_veth} master {bridge}",
            f"link set {host_veth} up",
        ]
    run_ip(["ip", "-batch", "-"], stdin="\n".join(lines) + "\n")
    for i in range(1, workers + 1):
        ns, _, ns_veth = worker_names(prefix, i)
        ns_lines = [
            f"addr add {subnet}.{10 + i}/24 dev {ns_veth}",
            f"link set {ns_veth} up",
            # The PySpark daemon and its python workers talk to their executor over 127.0.0.1.
            "link set lo up",
        ]
        run_ip(["ip", "-n", ns, "-batch", "-"], stdin="\n".join(ns_lines) + "\n")


def _namespaces(prefix: str) -> list[str]:
    ns_re = re.compile(rf"^{re.escape(prefix)}-w\d+$")
    listed = [
        line.split()[0] for line in run_ip(["ip", "netns", "list"], check=False).stdout.splitlines() if line
    ]
    return [n for n in listed if ns_re.match(n)]


def _links(prefix: str) -> list[str]:
    link_re = re.compile(rf"^{re.escape(prefix)}(w\d+[hn]|br0)$")
    links = []
    for line in run_ip(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if link_re.match(name):
                links.append(name)
    return links


def leftover_network(prefix: str) -> list[str]:
    """Namespaces and network devices with this prefix that still exist (empty when clean)."""
    return _namespaces(prefix) + _links(prefix)


def cleanup_network(prefix: str) -> None:
    """Remove every namespace / veth / bridge with this prefix (idempotent); end what runs inside."""
    namespaces = _namespaces(prefix)
    pids: set[int] = set()
    for ns in namespaces:
        pids |= netns_pids(ns)
    end_processes(pids, grace=5.0)
    # Delete host-side veths explicitly: the kernel removes a veth with its namespace only lazily.
    batch = [f"link del {name}" for name in sorted(_links(prefix), key=lambda n: n.endswith("br0"))]
    batch += [f"netns del {ns}" for ns in namespaces]
    if batch:
        run_ip(["ip", "-force", "-batch", "-"], stdin="\n".join(batch) + "\n", check=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not leftover_network(prefix):
            return
        time.sleep(0.1)
    raise ClusterError(f"network devices/namespaces still present after cleanup: {leftover_network(prefix)}")


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
