"""A throw-away Spark standalone cluster for tests, benchmarks and local runs.

The cluster is built from the installed ``pyspark`` (``bin/spark-class``), so no separate Spark
distribution is needed.  Two layouts are supported:

* **loopback** (default): the Master and every Worker bind to ``127.0.0.1`` on free ports.
* **netns** (``--netns``, root only): a Linux bridge ``<prefix>br0`` carrying ``<subnet>.1/24`` is
  created in the root namespace and every Worker runs in its own network namespace
  ``<prefix>-w<N>`` with address ``<subnet>.<10+N>``, connected to the bridge by a veth pair.  The
  Master and the Spark driver run in the root namespace on the bridge address, so each Worker and
  its executors really are on a different "host" as far as Spark (and torch.distributed) can tell.

Every daemon is started in a new session, so its session id equals its PID; ``down`` stops
everything in those sessions (executors, PySpark daemons and anything they spawned), plus whatever
is still inside the namespaces, then removes the network devices.

Modules: ``state`` (ClusterInfo, state.json, registry), ``netns`` (namespaces, veths, bridge),
``daemons`` (Master/Worker processes), ``cluster`` (up/status/down), ``__main__`` (the CLI).

CLI, from the repository root::

    python -m tests.cluster up --workers 2 --cores 1 --memory 1g --netns
    python -m tests.cluster status
    python -m tests.cluster down

Python::

    from tests.cluster import spark_cluster
    with spark_cluster(workers=2, cores=1, netns=True) as info:
        subprocess.run([info.spark_submit, *info.spark_submit_args(), "app.py"], env=info.driver_env())
"""

from tests.cluster.cluster import (
    cluster_status,
    restart_lost_workers,
    spark_cluster,
    start_cluster,
    stop_cluster,
)
from tests.cluster.daemons import cluster_logs, cluster_processes, wait_idle
from tests.cluster.netns import check_netns_connectivity, leftover_network
from tests.cluster.state import ClusterError, ClusterInfo, WorkerInfo

__all__ = [
    "restart_lost_workers",
    "ClusterError",
    "ClusterInfo",
    "WorkerInfo",
    "check_netns_connectivity",
    "cluster_logs",
    "cluster_processes",
    "cluster_status",
    "leftover_network",
    "spark_cluster",
    "start_cluster",
    "stop_cluster",
    "wait_idle",
]
