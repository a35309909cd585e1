"""Where a launch's seconds go, and what some Spark/JVM settings would save.

Usage: ``python bench/profile_launch.py [--rounds 3] [--quick]``

Runs ``workloads/hook_traced.py`` (the hook, instrumented from outside the package: see its
docstring) for several variants, interleaved, and splits each run's wall time into consecutive
phases from its timestamps: the hook process, spark-submit's scripts and launcher JVM, the
SparkSubmit JVM, the Python driver, SparkContext, the barrier stage's Python workers, the torch
import, ``allGather``, the torchrun agent, the ranks, and the shutdown. Medians per phase go to
``bench/results/latest.json`` (section ``profile``).

Variants besides the plain hook: ``fast_jvm_start=False`` (the driver JVM with Spark's own
defaults: no class-data archive, full JIT), and settings passed through the hook's ``conf``
(the Spark UI off). The hook's class-data archive is made by the uncounted warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import PYTHON, WORKLOADS, bench_env, log, machine_info, median, update_results

#: Phases of a distributed-mode launch: (key, label, start event, end event). Consecutive, so they
#: add up to the hook's wall time; events are resolved by :func:`timeline`.
DIST_PHASES = [
    ("hook_import", "hook process: interpreter + import Airflow, hook, cloudpickle", "spawn", "imported"),
    ("hook_stage", "hook init, connection lookup, staging (pickle, zip)", "imported", "popen"),
    (
        "submit_scripts",
        "spark-submit/spark-class scripts, find_spark_home.py, launcher JVM",
        "popen",
        "launcher_end",
    ),
    (
        "jvm_to_driver",
        "SparkSubmit JVM start until it forks the Python driver",
        "launcher_end",
        "driver_proc",
    ),
    ("driver_boot", "Python driver: interpreter start + imports", "driver_proc", "driver_imported"),
    (
        "driver_pre_sc",
        "driver: spec, channel, until SparkContext.getOrCreate",
        "driver_imported",
        "sc_create",
    ),
    (
        "sc_init",
        "SparkContext start (JVM SparkEnv, UI, executor; py4j; pandas via pyspark)",
        "sc_create",
        "sc_up",
    ),
    (
        "job_submit",
        "slot check, parallelize, pickle task, schedule, start pyspark.daemon",
        "sc_up",
        "daemon_proc",
    ),
    ("worker_boot", "pyspark.daemon start-up until it forks the task's worker", "daemon_proc", "worker_proc"),
    (
        "task_init",
        "worker: receive + unpickle task, import package from --py-files",
        "worker_proc",
        "task_start",
    ),
    ("task_torch", "task: import torch (launcher) before the rendezvous", "task_start", "launcher_imported"),
    (
        "rendezvous",
        "task 0's rendezvous endpoint via the driver (was allGather, which polls once a second)",
        "launcher_imported",
        "agent_start",
    ),
    (
        "agent_to_rank",
        "torchrun agent: static rendezvous, fork ranks, rank set-up",
        "agent_start",
        "rank_start",
    ),
    (
        "rank_fn",
        "the training function (DDP() lazily imports torch._dynamo: ~1.5 s)",
        "rank_start",
        "rank_end",
    ),
    ("rank_exit", "ranks exit, agent reaps them and returns", "rank_end", "agent_end"),
    ("collect", "task returns, collect() completes in the driver", "agent_end", "channel_close"),
    (
        "channel_close",
        "RunChannel.close (socketserver shutdown polls every 0.5 s)",
        "channel_close",
        "channel_closed",
    ),
    (
        "sc_stop",
        "SparkContext.stop (JVM stop; accumulator server polls every 0.5 s)",
        "channel_closed",
        "sc_stopped",
    ),
    ("driver_exit", "driver writes outcome, Python exits", "sc_stopped", "driver_gone"),
    ("jvm_exit", "SparkSubmit JVM shutdown until spark-submit's stdout closes", "driver_gone", "stdout_eof"),
    ("hook_after", "hook: outcome, kill of the process group, clean-up, unpickle", "stdout_eof", "done"),
]

LOCAL_PHASES = [
    DIST_PHASES[0],
    DIST_PHASES[1],
    DIST_PHASES[2],
    DIST_PHASES[3],
    ("driver_boot", "Python driver: interpreter start + imports", "driver_proc", "driver_imported"),
    ("driver_torch", "driver: import torch (launcher)", "driver_imported", "launcher_imported"),
    (
        "agent_to_rank",
        "torchrun agent: c10d standalone rendezvous, fork ranks",
        "launcher_imported",
        "rank_start",
    ),
    (
        "rank_fn",
        "the training function (DDP() lazily imports torch._dynamo: ~1.5 s)",
        "rank_start",
        "rank_end",
    ),
    ("rank_exit", "ranks exit, agent returns", "rank_end", "agent_end"),
    (
        "channel_close",
        "RunChannel.close (socketserver shutdown polls every 0.5 s)",
        "agent_end",
        "channel_closed",
    ),
    (
        "driver_exit",
        "driver writes outcome, Python (with torch loaded) exits",
        "channel_closed",
        "driver_gone",
    ),
    ("jvm_exit", "SparkSubmit JVM shutdown until spark-submit's stdout closes", "driver_gone", "stdout_eof"),
    ("hook_after", "hook: outcome, kill of the process group, clean-up, unpickle", "stdout_eof", "done"),
]


def _variants() -> dict[str, dict[str, Any]]:
    return {
        "distributed": {"mode": "--distributed"},
        "local": {"mode": "--local"},
        "distributed+fast_jvm_start=False": {"mode": "--distributed", "hook": {"fast_jvm_start": False}},
        "local+fast_jvm_start=False": {"mode": "--local", "hook": {"fast_jvm_start": False}},
        "distributed+ui_off": {"mode": "--distributed", "conf": {"spark.ui.enabled": "false"}},
    }


def traced_run(variant: dict[str, Any], workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """One instrumented hook run; returns its RESULT (stamps, processes, lines) plus the trace events."""
    trace = Path(tempfile.mkstemp(prefix="trace-", suffix=".jsonl", dir=workdir)[1])
    cmd = [PYTHON, str(WORKLOADS / "hook_traced.py"), variant["mode"], "--trace", str(trace)]
    for key, value in variant.get("conf", {}).items():
        cmd += ["--conf", f"{key}={value}"]
    for key, value in variant.get("env", {}).items():
        cmd += ["--env", f"{key}={value}"]
    if variant.get("hook", {}).get("fast_jvm_start") is False:
        cmd.append("--no-fast-jvm-start")
    import subprocess

    load = os.getloadavg()[0]
    spawn = time.time()
    proc = subprocess.run(cmd, env={**env, "BENCH_T_SPAWN": repr(spawn)}, capture_output=True, text=True)
    wall = time.time() - spawn
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"traced run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    result["events"] = [json.loads(ln) for ln in trace.read_text().splitlines() if ln.strip()]
    result["wall_s"] = wall
    result["load1"] = round(load, 2)
    trace.unlink()
    return result


def timeline(run: dict[str, Any]) -> dict[str, float]:
    """Named points in time (seconds since the hook process was spawned) from one traced run.

    Process start times come from psutil (``create_time``, 10 ms ticks but offset by the boot
    time's 1 s rounding); the offset is removed by aligning them with when the sampler first saw
    each process. Where a barrier task reports an event per node, the later node counts: the
    stage waits for the slowest.
    """
    t0 = run["t_spawn"]
    procs = run["procs"]
    offset = min(p["first_seen"] - p["created"] for p in procs) if procs else 0.0

    def created(pred: Any) -> float | None:
        found = [p["created"] + offset for p in procs if pred(p)]
        return min(found) - t0 if found else None

    def last_seen(pred: Any) -> float | None:
        found = [p.get("last_seen", p["first_seen"]) for p in procs if pred(p)]
        return max(found) - t0 if found else None

    events: dict[str, list[dict[str, Any]]] = {}
    for e in run["events"]:
        events.setdefault(e["e"], []).append(e)
    points: dict[str, float] = {name: max(x["t"] for x in evs) - t0 for name, evs in events.items()}
    driver_pid = events["driver_start"][0]["pid"]
    task_pids = {e["pid"] for e in events.get("task_start", [])}
    forked = {p["pid"] for p in procs if "pyspark.daemon" in p["cmd"]}  # daemon, workers, their ranks
    daemon = [p for p in procs if p["pid"] in forked and p["ppid"] not in forked]
    daemon_pids = {p["pid"] for p in daemon}
    points.update(
        spawn=0.0,
        imported=run["t_imported"] - t0,
        popen=run["popen"] - t0,
        launcher_end=last_seen(lambda p: "org.apache.spark.launcher.Main" in p["cmd"]) or run["popen"] - t0,
        driver_proc=created(lambda p: p["pid"] == driver_pid),
        driver_gone=last_seen(lambda p: p["pid"] == driver_pid),
        stdout_eof=run["stdout_eof"] - t0,
        done=run["t_done"] - t0,
        rank_start=run["rank0"]["t_start"] - t0,
        rank_end=run["rank0"]["t_end"] - t0,
    )
    if daemon:
        points["daemon_proc"] = created(lambda p: p["pid"] in daemon_pids)
        worker_times = [created(lambda p, pid=pid: p["pid"] == pid) for pid in task_pids]
        points["worker_proc"] = max(t for t in worker_times if t is not None)
    points["find_spark_home_s"] = (last_seen(lambda p: "find_spark_home" in p["cmd"]) or 0.0) - (
        created(lambda p: "find_spark_home" in p["cmd"]) or 0.0
    )
    return points


def phases(run: dict[str, Any], spec: list[tuple[str, str, str, str]]) -> dict[str, float]:
    """Durations of consecutive phases (seconds); ``total`` is the hook's wall time."""
    points = timeline(run)
    out = {}
    for key, _label, start, end in spec:
        a, b = points.get(start), points.get(end)
        out[key] = round(b - a, 3) if a is not None and b is not None else None
    out["total"] = round(points["done"], 3)
    out["find_spark_home"] = round(points["find_spark_home_s"], 3)
    if "rdzv_wait_start" in points:
        # how long the other tasks waited for task 0's endpoint once they asked
        out["rendezvous_wait"] = round(points["rdzv_wait_end"] - points["rdzv_wait_start"], 3)
    out["left_in_session"] = len(run.get("left_in_session", []))
    out["stop_process_group"] = round(run["stop_process_group_end"] - run["stop_process_group_start"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="run only these variants")
    parser.add_argument("--no-save", action="store_true", help="print only: leave latest.json and the README")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    workdir = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    env = bench_env()
    try:
        variants = {k: v for k, v in _variants().items() if not args.only or k in args.only}
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
        log("warm-up runs (uncounted; the first of each mode writes the hook's class-data archive)")
        for mode in dict.fromkeys(v["mode"] for v in variants.values()):
            traced_run({"mode": mode}, workdir, env)
        for round_no in range(1, rounds + 1):
            for name, variant in variants.items():
                run = traced_run(variant, workdir, env)
                spec = LOCAL_PHASES if variant["mode"] == "--local" else DIST_PHASES
                ph = phases(run, spec)
                ph["load1"] = run["load1"]
                runs[name].append(ph)
                log(f"round {round_no}/{rounds} {name}: {ph['total']:.2f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary: dict[str, Any] = {}
    for name, samples in runs.items():
        keys = [k for k in samples[0] if k != "load1"]
        summary[name] = {k: median([s[k] for s in samples if s.get(k) is not None]) for k in keys} | {
            "load1": [s["load1"] for s in samples],
            "n": len(samples),
        }
    for name, med in summary.items():
        log(f"{name:34s} total median {med['total']} s")
    if args.no_save:
        print(json.dumps(summary, indent=1))
        return 0
    update_results(
        "profile",
        {
            "machine": machine_info(),
            "rounds": rounds,
            "variants": {
                k: {kk: vv for kk, vv in v.items() if kk != "mode"} | {"mode": v["mode"][2:]}
                for k, v in variants.items()
            },
            "phases": {
                "distributed": [{"key": k, "label": lbl} for k, lbl, _, _ in DIST_PHASES],
                "local": [{"key": k, "label": lbl} for k, lbl, _, _ in LOCAL_PHASES],
            },
            "medians": summary,
            "samples": runs,
        },
    )
    from report import render_readme

    render_readme()
    return 0


if __name__ == "__main__":
    sys.exit(main())
