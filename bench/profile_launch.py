"""Where a launch's seconds go, and what some Spark/JVM settings would save.

Usage: ``python bench/profile_launch.py [--rounds 3] [--quick]``

Runs ``workloads/hook_traced.py`` (the hook with ``TORCHDIST_EVENT_LOG`` set, so every process of
the run appends the package's own phase events to one file; nothing is patched: see its
docstring) for several variants, interleaved, and splits each run's wall time into consecutive
phases from those events and the process starts and ends a sampler saw: the hook process,
spark-submit's scripts and launcher JVM, the SparkSubmit JVM, the Python driver, SparkContext, the
barrier stage's Python workers, the torch import, the rendezvous, the torchrun agent, the ranks,
and the shutdown. Medians per phase go to ``bench/results/latest.json`` (section ``profile``).

Variants besides the plain hook: ``fast_jvm_start=False`` (the driver JVM with Spark's own
defaults: no class-data archive, full JIT), settings passed through the hook's ``conf``
(the Spark UI off), and each start-up acceleration off on its own (``TORCHDIST_FAST_START_OFF``). The hook's class-data archive is made by the uncounted warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import PYTHON, WORKLOADS, bench_env, log, machine_info, median, update_results

#: Phases of a distributed-mode launch: (key, label, start point, end point). Consecutive, so they
#: add up to the hook's wall time. A point is a phase event of the package
#: (:data:`airflow_provider_torchdist.spark.wire.events.PHASES`), a process start or end seen by the
#: sampler, or a timestamp of the traced process itself; :func:`timeline` resolves them.
DIST_PHASES = [
    ("hook_import", "hook process: interpreter + import Airflow, hook, cloudpickle", "spawn", "imported"),
    (
        "hook_stage",
        "hook init, connection, checks, staging (pickle, zip), plan",
        "imported",
        "spark_submit_start",
    ),
    (
        "submit_scripts",
        "spark-submit/spark-class scripts, find_spark_home.py, launcher JVM",
        "spark_submit_start",
        "launcher_end",
    ),
    (
        "jvm_to_driver",
        "SparkSubmit JVM start until it forks the Python driver",
        "launcher_end",
        "driver_proc",
    ),
    ("driver_boot", "Python driver: interpreter start + package imports", "driver_proc", "driver_start"),
    (
        "driver_pre_sc",
        "driver: import pyspark, until SparkContext.getOrCreate",
        "driver_start",
        "spark_context_start",
    ),
    (
        "sc_init",
        "SparkContext start (JVM SparkEnv, UI, executor; py4j)",
        "spark_context_start",
        "spark_context_up",
    ),
    (
        "job_submit",
        "run channel, slot check, parallelize, pickle task, schedule, start pyspark.daemon",
        "spark_context_up",
        "daemon_proc",
    ),
    ("worker_boot", "pyspark.daemon start-up until it forks the task's worker", "daemon_proc", "worker_proc"),
    (
        "task_init",
        "worker: receive + unpickle task, import package from --py-files",
        "worker_proc",
        "task_start",
    ),
    ("task_torch", "task: import torch (launcher)", "task_start", "launcher_imported"),
    (
        "rendezvous",
        "task 0's rendezvous endpoint via the driver's run channel",
        "launcher_imported",
        "rendezvous_done",
    ),
    (
        "agent_to_rank",
        "torchrun agent: static rendezvous, fork ranks, rank set-up",
        "rendezvous_done",
        "rank_start",
    ),
    (
        "rank_fn",
        "the training function (DDP() lazily imports torch._dynamo: ~1.5 s)",
        "rank_start",
        "rank_returned",
    ),
    ("rank_exit", "rank 0 sends its value, ranks exit, agent reaps them", "rank_returned", "agent_end"),
    ("collect", "task returns, collect() completes in the driver", "agent_end", "channel_close"),
    ("channel_close", "RunChannel.close", "channel_close", "channel_closed"),
    ("sc_stop", "SparkContext.stop (JVM stop)", "channel_closed", "spark_stopped"),
    ("driver_exit", "driver writes outcome, Python exits", "spark_stopped", "driver_gone"),
    (
        "jvm_exit",
        "SparkSubmit JVM shutdown until spark-submit has exited",
        "driver_gone",
        "spark_submit_end",
    ),
    (
        "hook_after",
        "hook: follower stop, outcome, read the value, end the session, clean up",
        "spark_submit_end",
        "done",
    ),
]

LOCAL_PHASES = [
    DIST_PHASES[0],
    DIST_PHASES[1],
    DIST_PHASES[2],
    DIST_PHASES[3],
    DIST_PHASES[4],
    ("driver_torch", "driver: import torch (launcher)", "driver_start", "launcher_imported"),
    (
        "agent_to_rank",
        "torchrun agent: standalone rendezvous, fork ranks",
        "launcher_imported",
        "rank_start",
    ),
    DIST_PHASES[13],
    ("rank_exit", "rank 0 writes its value, ranks exit, agent returns", "rank_returned", "agent_end"),
    ("channel_close", "RunChannel.close", "agent_end", "channel_closed"),
    (
        "driver_exit",
        "driver writes outcome, Python (with torch loaded) exits",
        "channel_closed",
        "driver_gone",
    ),
    DIST_PHASES[19],
    DIST_PHASES[20],
]

#: The operator's path (``start_run`` + ``follow``): the task starts the run's detached supervisor,
#: which imports the Spark provider (and so Airflow) and starts spark-submit; the run itself is the
#: distributed one; at its end the supervisor reads the verdict and the task gets it over the lifeline.
SUPERVISED_PHASES = [
    DIST_PHASES[0],
    (
        "hook_stage",
        "hook init, connection, checks, staging (pickle, zip), plan",
        "imported",
        "supervisor_start",
    ),
    (
        "supervisor_listen",
        "supervisor: forked from the task (a new interpreter: its start and package imports), lock, "
        "lifeline listening; the task connects",
        "supervisor_start",
        "supervisor_listening",
    ),
    (
        "supervisor_submit",
        "supervisor: SparkSubmitHook with its connection (a new interpreter imports the Spark provider "
        "and Airflow first)",
        "supervisor_listening",
        "spark_submit_start",
    ),
    *DIST_PHASES[2:17],
    (
        "handover",
        "driver writes its outcome; the supervisor sees it (50 ms poll), gives the verdict; the task "
        "reads the value (Spark's stop goes on off this path: stop_after_handover)",
        "channel_closed",
        "done",
    ),
]

#: Spans that are not consecutive phases: (key, start point, end point).
EXTRA_SPANS = [
    ("hook_init", "imported", "hook_start"),
    ("staging", "hook_start", "staged"),
    ("plan", "staged", "spark_submit_start"),
    ("output_send", "rank_returned#0", "output_sent"),
    ("follower_and_outcome", "spark_submit_end", "outcome_read"),
    ("session_end", "outcome_read", "session_ended"),
    # Off the operator's path since its verdict comes with the outcome: Spark's own stop.
    ("stop_after_handover", "done", "spark_submit_end"),
]


def _variants() -> dict[str, dict[str, Any]]:
    return {
        "distributed": {"mode": "--distributed"},
        "local": {"mode": "--local"},
        "supervised": {"mode": "--distributed", "supervised": True},
        # The supervisor as a new interpreter, as before it was forked from the task.
        "supervised+exec": {
            "mode": "--distributed",
            "supervised": True,
            "process_env": {"AIRFLOW__TORCHDIST__SUPERVISOR_START": "exec"},
        },
        "distributed+fast_jvm_start=False": {"mode": "--distributed", "hook": {"fast_jvm_start": False}},
        "local+fast_jvm_start=False": {"mode": "--local", "hook": {"fast_jvm_start": False}},
        "distributed+ui_off": {"mode": "--distributed", "conf": {"spark.ui.enabled": "false"}},
        # One start-up acceleration off at a time (the benchmarking knob of fast_start.py).
        **{
            f"distributed+{part}_off": {"mode": "--distributed", "env": {"TORCHDIST_FAST_START_OFF": part}}
            for part in ("jvm", "torch")
        },
    }


def phase_spec(variant: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The consecutive phases of ``variant``'s launch."""
    if variant.get("supervised"):
        return SUPERVISED_PHASES
    return LOCAL_PHASES if variant["mode"] == "--local" else DIST_PHASES


def traced_run(variant: dict[str, Any], workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """One observed hook run; returns its RESULT: its own timestamps, the events, the processes."""
    trace = Path(tempfile.mkstemp(prefix="trace-", suffix=".jsonl", dir=workdir)[1])
    cmd = [PYTHON, str(WORKLOADS / "hook_traced.py"), variant["mode"], "--trace", str(trace)]
    if variant.get("supervised"):
        cmd.append("--supervised")
    for key, value in variant.get("conf", {}).items():
        cmd += ["--conf", f"{key}={value}"]
    for key, value in variant.get("env", {}).items():
        cmd += ["--env", f"{key}={value}"]
    if variant.get("hook", {}).get("fast_jvm_start") is False:
        cmd.append("--no-fast-jvm-start")
    load = os.getloadavg()[0]
    spawn = time.time()
    run_env = {**env, **variant.get("process_env", {}), "BENCH_T_SPAWN": repr(spawn)}
    proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
    wall = time.time() - spawn
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"traced run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    result["wall_s"] = wall
    result["load1"] = round(load, 2)
    trace.unlink()
    return result


def timeline(run: dict[str, Any]) -> dict[str, float]:
    """Named points in time (seconds since the hook process was spawned) from one observed run.

    Each phase event is a point; where several processes emit it (one per node or rank), the later
    counts: the stage waits for the slowest. ``phase#N`` is node or rank N's own. Process start
    times come from psutil (``create_time``, 10 ms ticks but offset by the boot time's 1 s
    rounding); the offset is removed by aligning them with when the sampler first saw each process.
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
    points: dict[str, float] = {}
    for e in run["events"]:
        events.setdefault(e["phase"], []).append(e)
        who = e.get("node", e.get("rank"))
        if who is not None:
            points[f"{e['phase']}#{who}"] = e["t"] - t0
    points.update({name: max(x["t"] for x in evs) - t0 for name, evs in events.items()})
    driver_pid = events["driver_start"][0]["pid"]
    task_pids = {e["pid"] for e in events.get("task_start", [])}
    # The daemon, its workers and their ranks: Spark's daemon, or the one a local master starts with
    # the installed pyspark (spark/node/daemon.py).
    daemons = ("pyspark.daemon", "airflow_provider_torchdist.spark.node.daemon")
    forked = {p["pid"] for p in procs if any(d in p["cmd"] for d in daemons)}
    daemon_pids = {p["pid"] for p in procs if p["pid"] in forked and p["ppid"] not in forked}
    points.update(
        spawn=0.0,
        imported=run["t_imported"] - t0,
        launcher_end=last_seen(lambda p: "org.apache.spark.launcher.Main" in p["cmd"])
        or points["spark_submit_start"],
        driver_proc=created(lambda p: p["pid"] == driver_pid),
        driver_gone=last_seen(lambda p: p["pid"] == driver_pid),
        done=run["t_done"] - t0,
    )
    if daemon_pids:
        points["daemon_proc"] = created(lambda p: p["pid"] in daemon_pids)
        worker_times = [created(lambda p, pid=pid: p["pid"] == pid) for pid in task_pids]
        points["worker_proc"] = max(t for t in worker_times if t is not None)
    points["find_spark_home_s"] = (last_seen(lambda p: "find_spark_home" in p["cmd"]) or 0.0) - (
        created(lambda p: "find_spark_home" in p["cmd"]) or 0.0
    )
    return {k: v for k, v in points.items() if v is not None}


def phases(run: dict[str, Any], spec: list[tuple[str, str, str, str]]) -> dict[str, float]:
    """Durations of consecutive phases (seconds); ``total`` is the hook's wall time."""
    points = timeline(run)
    out = {}
    for key, _label, start, end in spec:
        a, b = points.get(start), points.get(end)
        out[key] = round(b - a, 3) if a is not None and b is not None else None
    out["total"] = round(points["done"], 3)
    for key, start, end in EXTRA_SPANS:
        a, b = points.get(start), points.get(end)
        out[key] = round(b - a, 3) if a is not None and b is not None else None
    out["find_spark_home"] = round(points["find_spark_home_s"], 3)
    waits = [
        points[f"rendezvous_done#{n}"] - points[f"launcher_imported#{n}"]
        for n in range(1, 64)
        if f"rendezvous_done#{n}" in points and f"launcher_imported#{n}" in points
    ]
    if waits:  # how long the other tasks waited for task 0's endpoint once they asked
        out["rendezvous_wait"] = round(max(waits), 3)
    out["left_after_run"] = len(run.get("left_after_run", []))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="run only these variants")
    parser.add_argument("--no-save", action="store_true", help="print only: leave latest.json and the docs")
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
                spec = phase_spec(variant)
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
                "supervised": [{"key": k, "label": lbl} for k, lbl, _, _ in SUPERVISED_PHASES],
            },
            "medians": summary,
            "samples": runs,
        },
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
