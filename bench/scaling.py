"""Scaling: launch overhead for 1, 2 and 4 processes on a Spark standalone cluster vs. raw torchrun.

Usage: ``python bench/scaling.py [--rounds 3] [--quick] [--sizes 1 2 4]``

Starts a loopback standalone cluster (``tests.cluster``, prefix ``tdbench``: a Master and
one 1-core Worker per process, so every barrier task gets an executor of its own, like one node
each) and stops it again at the end, by the PIDs it started. Per round and size N, interleaved:

- ``torchrun``: ``torchrun --standalone --nproc_per_node=N`` on the trivial DDP workload;
- ``hook``: ``TorchDistributorHook(num_processes=N, local_mode=False)`` on the cluster: N barrier
  tasks of one process each (a fresh interpreter per sample: imports count, as in a task).

Each sample is timed from just before the fork to just after the exit; rank 0 also reports when it
started, when ``init_process_group`` returned and when it finished, which splits the wall time into
"until rank 0 runs", "process group join", "training" and "after training". One uncounted warm-up
round first; medians go to ``bench/results/latest.json`` (section ``scaling``) and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BIN,
    PYTHON,
    REPO,
    WORKLOADS,
    bench_env,
    log,
    machine_info,
    median,
    run_timed,
    update_results,
)

# Bench scripts run as files (``python bench/scaling.py``): the repository root makes ``tests`` importable.
sys.path.insert(0, str(REPO))
from tests.cluster import ClusterInfo, start_cluster, stop_cluster  # noqa: E402

PREFIX = "tdbench"
WORKLOAD = WORKLOADS / "scaling_run.py"


def commands(n: int) -> dict[str, list[str]]:
    return {
        "torchrun": [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={n}", str(WORKLOAD)],
        "hook": [PYTHON, str(WORKLOAD), "--hook", "--n", str(n)],
    }


def connection(info: ClusterInfo) -> str:
    """The ``torchdist_bench`` Spark connection to the cluster, with its master web UI."""
    return json.dumps(
        {
            "conn_type": "spark",
            "host": f"spark://{info.master_host}",
            "port": info.master_port,
            "extra": {"master-web-ui": info.master_ui_url, "deploy-mode": "client"},
        }
    )


def one(cmd: list[str], env: dict[str, str]) -> dict[str, Any] | None:
    t_fork = time.time()
    sample = run_timed(cmd, env)
    if sample.rc != 0 or not sample.result:
        log(f"FAILED {' '.join(cmd[-3:])}:\n{sample.tail}")
        return None
    v = sample.result["value"]
    t_exit = t_fork + sample.wall_s
    return {
        "wall_s": sample.wall_s,
        "until_rank0_s": round(v["t_start"] - t_fork, 3),
        "join_s": round(v["t_joined"] - v["t_start"], 3),
        "train_s": round(v["t_end"] - v["t_joined"], 3),
        "after_s": round(t_exit - v["t_end"], 3),
        "load_before": sample.load_before,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(n): {"torchrun": [], "hook": []} for n in args.sizes
    }
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        t0 = time.monotonic()
        info = start_cluster(
            workers=max(args.sizes), cores=1, memory="1g", prefix=PREFIX, state_dir=Path(tmp) / "cluster"
        )
        log(f"cluster {info.master_url}: {len(info.workers)} workers up in {time.monotonic() - t0:.1f} s")
        try:
            env = bench_env(AIRFLOW_CONN_TORCHDIST_BENCH=connection(info))
            for round_no in range(0, rounds + 1):
                for n in args.sizes:
                    for launcher, cmd in commands(n).items():
                        row = one(cmd, env)
                        if row is None:
                            continue
                        tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
                        log(
                            f"{tag} N={n} {launcher}: {row['wall_s']:.2f} s (rank 0 after {row['until_rank0_s']:.2f} s, "
                            f"join {row['join_s']:.2f} s, after training {row['after_s']:.2f} s)"
                        )
                        if round_no:
                            samples[str(n)][launcher].append(row)
        finally:
            stop_cluster(info)
    stats: dict[str, Any] = {}
    for n, by_launcher in samples.items():
        stats[n] = {}
        for launcher, rows in by_launcher.items():
            keys = ("wall_s", "until_rank0_s", "join_s", "train_s", "after_s")
            stats[n][launcher] = {k: median([r[k] for r in rows]) for k in keys} | {"n": len(rows)}
        hook, raw = stats[n]["hook"]["wall_s"], stats[n]["torchrun"]["wall_s"]
        if hook and raw:
            stats[n]["overhead_s"] = round(hook - raw, 3)
            stats[n]["ratio"] = round(hook / raw, 2)
    update_results(
        "scaling",
        {
            "machine": machine_info(),
            "rounds": rounds,
            "cluster": {"workers": max(args.sizes), "cores_per_worker": 1, "worker_memory": "1g"},
            "stats": stats,
            "samples": samples,
        },
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
