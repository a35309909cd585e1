"""What a running cluster is: its description (also the ``state.json`` schema) and where it is kept.

``up`` writes ``<state_dir>/state.json`` early and often, and a pointer file per prefix under
``$TMPDIR/torchdist-spark-clusters/``, so that ``status`` and ``down`` (and the next ``up``) find the
cluster even when the process that started it died half-way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import psutil

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

    @property
    def serving(self) -> bool:
        """Whether its daemon is alive and not stopped: a frozen (SIGSTOPped) Worker serves nothing,
        yet the Master lists it ALIVE until its timeout, and a SIGKILL may not have ended it yet."""
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
        return False


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
    #: Spark properties of every Worker daemon (start_cluster's ``worker_conf``): a Worker started
    #: again (``restart_lost_workers``) gets them too.
    worker_conf: dict[str, str] = dataclasses.field(default_factory=dict)

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


def write_state(info: ClusterInfo) -> None:
    """Write ``state.json`` atomically (a reader never sees half a file)."""
    path = Path(info.state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.to_json())
    tmp.replace(path)


def registry_file(prefix: str) -> Path:
    """The pointer file naming the state dir of the cluster with this prefix."""
    return REGISTRY_DIR / f"{prefix}.json"


def register(info: ClusterInfo) -> None:
    """Point the registry entry of ``info.prefix`` at its state dir."""
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    registry_file(info.prefix).write_text(json.dumps({"state_dir": str(info.state_dir)}))


def registered_state_dir(prefix: str) -> Path | None:
    """The state dir the registry names for this prefix (None if there is no entry)."""
    reg = registry_file(prefix)
    if not reg.exists():
        return None
    return Path(json.loads(reg.read_text())["state_dir"])


def validate_names(prefix: str, subnet: str) -> None:
    """Check the prefix fits interface names and the subnet is a private /24."""
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


def unregister(info: ClusterInfo) -> None:
    """Remove the registry entry of ``info.prefix`` if it still points at this cluster's state dir."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        registered = registered_state_dir(info.prefix)
        if registered is not None and registered.resolve() == Path(info.state_dir).resolve():
            registry_file(info.prefix).unlink()
