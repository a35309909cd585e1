"""``python -m tests.cluster up|status|down``: start, inspect or stop a local Spark standalone cluster.

Run from the repository root. ``up`` prints the master URL and web UI; ``down`` stops what ``up``
started, by PID, and removes the namespaces and devices of the prefix (even without a state file).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.cluster.cluster import cluster_status, start_cluster, stop_cluster
from tests.cluster.netns import cleanup_network
from tests.cluster.state import (
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    STATE_FILE,
    ClusterError,
    ClusterInfo,
    registered_state_dir,
)


def _default_state_dir(prefix: str) -> Path:
    return Path(tempfile.gettempdir()) / f"torchdist-spark-{prefix}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster",
        description="Start and stop a throw-away Spark standalone cluster for tests and local runs.",
    )
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
    return parser


def _up(args: argparse.Namespace) -> int:
    info = start_cluster(
        workers=args.workers,
        cores=args.cores,
        memory=args.memory,
        netns=args.netns,
        state_dir=Path(args.state_dir or _default_state_dir(args.prefix)),
        prefix=args.prefix,
        subnet=args.subnet,
        timeout=args.timeout,
        parallel_start=args.parallel,
    )
    host = info.driver_host
    print(f"master:  {info.master_url}")
    print(f"ui:      {info.master_ui_url}")
    print(f"driver:  --conf spark.driver.host={host} --conf spark.driver.bindAddress={host}")
    print(f"workers: {', '.join(w.host + (f' ({w.netns})' if w.netns else '') for w in info.workers)}")
    print(f"state:   {info.state_dir}/{STATE_FILE}")
    print(f"up in {info.startup_seconds:.2f}s {info.timings}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``up``, ``down`` or ``status``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.action == "up":
        return _up(args)

    if args.state_dir:
        state_dir = Path(args.state_dir)
    else:
        state_dir = registered_state_dir(args.prefix) or _default_state_dir(args.prefix)
    if not (state_dir / STATE_FILE).exists():
        if args.action == "down":
            # Nothing recorded; still remove namespaces/devices a crashed run may have left behind.
            cleanup_network(args.prefix)
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
