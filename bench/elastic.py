"""Elastic runs on a two-host netns cluster: the launch cost of a range, and the time a loss costs.

Usage: ``python bench/elastic.py [--rounds 3] [--quick]`` (root: the cluster's hosts are network
namespaces, as in the worker-loss tests).

1. **Launch cost**: the same 2-rank all-reduce, ``hook.run`` wall time, with ``num_processes=2``
   (a barrier stage, static rendezvous) and ``num_processes="2:2"`` (an ordinary stage, torchrun's
   ``c10d`` rendezvous on the driver's store), interleaved after an uncounted warm-up of each.
2. **Loss to resumed training**: ``num_processes="1:2"``; once both ranks train, the Worker and
   executor JVMs on rank 0's host are SIGKILLed; measured until the survivor, as rank 0 of world
   size 1, has loaded the latest checkpoint and trains again (the rank's own marker file). The lost
   Worker is started again before the next round. Goal: <= 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import log, machine_info, median, update_results  # noqa: E402

from tests.cluster import ClusterInfo, restart_lost_workers, start_cluster, stop_cluster  # noqa: E402

PREFIX, SUBNET = "tdbe", "10.231.97"
DRIVER_HOST = f"{SUBNET}.1"
RESUME_GOAL_S = 30.0


def allreduce_once() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def train_with_checkpoints(marker_dir: str, steps: int) -> int:
    """``steps`` all-reduces from the latest checkpoint; notes ``w<size>-rank<rank>.json`` on start."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start, _ = load_latest_checkpoint() or (0, None)
    Path(marker_dir, f"w{world}-rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "at": time.time()})
    )
    for step in range(start, steps):
        dist.all_reduce(torch.ones(1))
        if step % 5 == 4:
            save_checkpoint({"step": step}, step + 1)
        time.sleep(0.05)
    return world


def make_hook(cluster: ClusterInfo, **settings: Any) -> Any:
    from airflow_provider_torchdist import TorchDistributorHook

    conn = {"conn_type": "spark", "host": f"spark://{cluster.master_host}", "port": cluster.master_port}
    os.environ["AIRFLOW_CONN_SPARK_BENCH_ELASTIC"] = json.dumps(conn)
    return TorchDistributorHook(
        conn_id="spark_bench_elastic",
        conf={
            "spark.driver.host": DRIVER_HOST,
            "spark.driver.bindAddress": DRIVER_HOST,
            "spark.executor.memory": "512m",
            "spark.ui.showConsoleProgress": "false",
        },
        env_vars={"SPARK_LOCAL_IP": DRIVER_HOST},
        **settings,
    )


def launch_round(cluster: ClusterInfo, num_processes: int | str) -> float:
    hook = make_hook(cluster, num_processes=num_processes, join_window=1)  # MIN=MAX: never waited
    started = time.monotonic()
    assert hook.run(allreduce_once) == 2
    return time.monotonic() - started


def _worker_above(pid: int, cluster: ClusterInfo) -> tuple[int, int]:
    """(Worker PID, executor PID) above a rank's PID."""
    import psutil

    workers = {w.pid for w in cluster.workers}
    executor = None
    for proc in psutil.Process(pid).parents():
        if "CoarseGrainedExecutorBackend" in " ".join(proc.cmdline()):
            executor = proc.pid
        if proc.pid in workers:
            assert executor is not None
            return proc.pid, executor
    raise RuntimeError(f"no Worker above rank PID {pid}")


def loss_round(cluster: ClusterInfo, tmp: Path) -> dict[str, Any]:
    markers = Path(tempfile.mkdtemp(dir=tmp))
    hook = make_hook(
        cluster, num_processes="1:2", join_window=2, max_restarts=2, checkpoint_dir=str(markers / "ckpt")
    )
    errors: list[BaseException] = []
    runner = threading.Thread(target=lambda: _run(hook, errors, str(markers)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 150
    while not all((markers / f"w2-rank{r}.json").exists() for r in (0, 1)):
        if not runner.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the ranks never started: {errors}")
        time.sleep(0.05)
    time.sleep(2.0)
    rank0 = json.loads((markers / "w2-rank0.json").read_text())["pid"]
    for pid in _worker_above(rank0, cluster):
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    runner.join(300)
    if errors or runner.is_alive():
        raise RuntimeError(f"the elastic run did not survive the loss: {errors}")
    resumed = json.loads((markers / "w1-rank0.json").read_text())["at"]
    return {
        "resume_s": round(resumed - killed, 3),
        "world_sizes": [e["world_size"] for e in hook.world_sizes],
    }


def _run(hook: Any, errors: list[BaseException], markers: str) -> None:
    try:
        hook.run(train_with_checkpoints, markers, 300)
    except BaseException as exc:  # noqa: BLE001 - reported by the caller
        errors.append(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    cluster = start_cluster(workers=2, cores=1, memory="1g", netns=True, prefix=PREFIX, subnet=SUBNET)
    launches: dict[str, list[float]] = {"fixed": [], "elastic": []}
    losses: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
            for round_no in range(rounds + 1):
                for name, n in (("fixed", 2), ("elastic", "2:2")):
                    wall = launch_round(cluster, n)
                    log(f"{'warm-up' if not round_no else f'round {round_no}'} {name}: {wall:.2f} s")
                    if round_no:
                        launches[name].append(round(wall, 3))
            for round_no in range(1, rounds + 1):
                restart_lost_workers(cluster)
                loss = loss_round(cluster, Path(tmp))
                log(
                    f"loss round {round_no}: resumed {loss['resume_s']:.1f} s after the loss, {loss['world_sizes']}"
                )
                losses.append(loss)
    finally:
        stop_cluster(cluster)
    fixed, elastic = median(launches["fixed"]), median(launches["elastic"])
    resume = median([loss["resume_s"] for loss in losses])
    stats = {
        "fixed_median_s": fixed,
        "elastic_median_s": elastic,
        "elastic_over_fixed": round(elastic / fixed, 3) if fixed and elastic else None,
        "resume_median_s": resume,
        "resume_max_s": max(loss["resume_s"] for loss in losses) if losses else None,
        "resume_goal_s": RESUME_GOAL_S,
        "met": resume is not None and resume <= RESUME_GOAL_S,
    }
    log(f"elastic/fixed launch {stats['elastic_over_fixed']}, loss to resumed training median {resume} s")
    update_results(
        "elastic",
        {"machine": machine_info(), "rounds": rounds, "stats": stats, "launches": launches, "losses": losses},
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
