"""Launch overhead: the trivial 2-rank DDP workload through every launcher, interleaved.

Usage: ``python bench/launch.py [--rounds 3] [--quick] [--only NAME ...] [--baseline REV] [--fast-start]``

``--baseline REV`` adds the hook variants once more with the provider as it was at git revision
``REV`` (checked out into a temporary worktree, first on ``PYTHONPATH``), interleaved with the
others: a change's launch cost against the code before it, measured in the same run.

``--fast-start`` measures what each start-up acceleration of ``fast_start.py`` saves now: raw
torchrun, ``hook_distributed``, and ``hook_distributed`` with one part switched off at a time
(``TORCHDIST_FAST_START_OFF=jvm``, ``spark_home``, ``exit``) and with all three off, interleaved.
A part's saving is the median over rounds of (its variant minus ``hook_distributed`` in the same
round). Written to its own section, ``fast_start``.

Each round runs every variant once, in order (A B C ... A B C ...), after one uncounted warm-up
round, so drifting machine load hits all variants alike. Each sample is a fresh process tree,
timed from just before the fork to just after the exit. Medians and ratios go to
``bench/results/latest.json`` (section ``launch``), ``docs/benchmarks.md`` and the README summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.integration's Connect server

from common import (  # noqa: E402
    BIN,
    PYTHON,
    REPO,
    WORKLOADS,
    bench_env,
    log,
    machine_info,
    make_airflow_home,
    median,
    run_timed,
    sample_dict,
    spark_submit_cmd,
    update_results,
)

from tests.integration.connect_server import start_connect_server  # noqa: E402

#: The bench's Spark Connect connection (an AIRFLOW_CONN_ variable naming the warm server).
CONNECT_CONN_ID = "bench_connect"
#: Ray Train's environment (``bash bench/ray-env``): Ray is no dependency of this project.
RAY_PYTHON = REPO / ".venv-ray" / "bin" / "python"
#: Where the warm Ray cluster's head listens (127.0.0.1 only); ``ray_warm`` joins it.
RAY_ADDRESS_ENV = "BENCH_RAY_ADDRESS"
#: Ray's processes: the workloads on their path, and loopback only (Ray's own switch for a
#: single-machine cluster: Ray Train's workers then give gloo 127.0.0.1, not the machine's address).
RAY_ENV = {
    "PYTHONPATH": str(WORKLOADS),
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}


@dataclass(frozen=True)
class Variant:
    """One way of launching the workload."""

    name: str
    label: str
    command: Callable[[], list[str]]
    check: Callable[[dict[str, Any] | None], bool] = lambda result: True
    #: Environment on top of the benchmark's (the baseline's PYTHONPATH).
    env: dict[str, str] = field(default_factory=dict)
    #: Working directory: the baseline's tree, so that no process of it imports this checkout's
    #: provider from its current directory (Spark's Python workers have it on their path).
    cwd: Path = REPO


def baseline_variants(rev: str, tree: Path) -> list[Variant]:
    """The hook variants again, importing the provider from ``tree`` (a worktree of ``rev``)."""
    return [
        Variant(f"{v.name}@base", f"{v.label}, at {rev}", v.command, v.check, {"PYTHONPATH": str(tree)}, tree)
        for v in VARIANTS
        if v.name in ("hook_local", "hook_distributed", "hook_supervised", "hook_supervised_local")
    ]


def _value_ok(result: dict[str, Any] | None) -> bool:
    value = (result or {}).get("value") or {}
    return value.get("world_size") == 2 and value.get("allreduce") == 3.0


def _dag_ok(result: dict[str, Any] | None) -> bool:
    return str((result or {}).get("state", "")).endswith("success")


VARIANTS = [
    Variant(
        "torchrun",
        "raw `torchrun --standalone --nproc_per_node=2`",
        lambda: [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            str(WORKLOADS / "ddp_trivial.py"),
        ],
    ),
    Variant(
        "spark_empty",
        "`spark-submit local[2]`, empty 2-task barrier stage",
        lambda: spark_submit_cmd(WORKLOADS / "spark_empty.py"),
    ),
    Variant(
        "pyspark_local",
        "PySpark `TorchDistributor`, local_mode=True",
        lambda: spark_submit_cmd(WORKLOADS / "pyspark_td.py", "--local"),
        _value_ok,
    ),
    Variant(
        "pyspark_distributed",
        "PySpark `TorchDistributor`, local_mode=False",
        lambda: spark_submit_cmd(WORKLOADS / "pyspark_td.py", "--distributed"),
        _value_ok,
    ),
    Variant(
        "hook_local",
        "this project, `TorchDistributorHook` local_mode=True",
        lambda: [PYTHON, str(WORKLOADS / "hook_run.py"), "--local"],
        _value_ok,
    ),
    Variant(
        "hook_distributed",
        "this project, `TorchDistributorHook` local_mode=False",
        lambda: [PYTHON, str(WORKLOADS / "hook_run.py"), "--distributed"],
        _value_ok,
    ),
    Variant(
        "hook_connect",
        "this project over Spark Connect: `TorchDistributorHook(conn_id=<spark_connect>)`, local_mode=False, "
        "against a warm Connect server (`local[2]`, started once before the rounds)",
        lambda: [PYTHON, str(WORKLOADS / "hook_run.py"), "--distributed", "--conn-id", CONNECT_CONN_ID],
        _value_ok,
    ),
    Variant(
        "hook_supervised",
        "this project, `TorchDistributorHook.start_run` + `follow` (the operator's path: a "
        "detached supervisor and its lifeline), local_mode=False",
        lambda: [PYTHON, str(WORKLOADS / "hook_run.py"), "--distributed", "--supervised"],
        _value_ok,
    ),
    Variant(
        "hook_supervised_local",
        "this project, `TorchDistributorHook.start_run` + `follow` (the operator's path), local_mode=True",
        lambda: [PYTHON, str(WORKLOADS / "hook_run.py"), "--local", "--supervised"],
        _value_ok,
    ),
    Variant(
        "ray_cold",
        "Ray Train `TorchTrainer` (2 CPU workers, gloo), cold: a new local Ray cluster per launch",
        lambda: [str(RAY_PYTHON), str(WORKLOADS / "ray_train.py")],
        _value_ok,
        RAY_ENV,
    ),
    Variant(
        "ray_warm",
        "Ray Train `TorchTrainer` (2 CPU workers, gloo), warm: joins a running Ray cluster "
        "(started once before the rounds)",
        lambda: [str(RAY_PYTHON), str(WORKLOADS / "ray_train.py"), "--address", os.environ[RAY_ADDRESS_ENV]],
        _value_ok,
        RAY_ENV,
    ),
    Variant(
        "dag_local",
        "this project, operator in `dag.test()`, local_mode=True",
        lambda: [PYTHON, str(WORKLOADS / "dag_run.py"), "bench_torchdist_local"],
        _dag_ok,
    ),
    Variant(
        "dag_distributed",
        "this project, operator in `dag.test()`, local_mode=False",
        lambda: [PYTHON, str(WORKLOADS / "dag_run.py"), "bench_torchdist_distributed"],
        _dag_ok,
    ),
]

#: The parts of ``fast_start.py`` that ``TORCHDIST_FAST_START_OFF`` switches off (a benchmarking knob).
FAST_START_PARTS = {
    "jvm": "driver JVM class-data archive + C1-only JIT",
    "pyspark": "the executors' Python daemon imports the installed pyspark, not pyspark.zip (local master)",
    "torch": "the executors' Python daemon loads torch before it forks the barrier tasks' workers (local master)",
}
#: A part that saves less than this is a candidate for removal (issue 12).
FAST_START_KEEP_S = 0.5


def fast_start_variants() -> list[Variant]:
    """Raw torchrun, ``hook_distributed``, and ``hook_distributed`` with each part (and all) off."""
    by_name = {v.name: v for v in VARIANTS}
    hook = by_name["hook_distributed"]
    return [
        by_name["torchrun"],
        hook,
        *(
            Variant(
                f"hook_distributed-{part}",
                f"{hook.label}, {what} off (`TORCHDIST_FAST_START_OFF={part}`)",
                hook.command,
                hook.check,
                {"TORCHDIST_FAST_START_OFF": part},
            )
            for part, what in FAST_START_PARTS.items()
        ),
    ]


def fast_start_savings(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per part: what switching it off costs, paired by round against ``hook_distributed``."""
    on = {s["round"]: s["wall_s"] for s in samples.get("hook_distributed", []) if s["ok"]}
    savings = {}
    for part in FAST_START_PARTS:
        off = {s["round"]: s["wall_s"] for s in samples.get(f"hook_distributed-{part}", []) if s["ok"]}
        diffs = [round(off[r] - on[r], 3) for r in sorted(off) if r in on]
        saving = median(diffs)
        savings[part] = {
            "median_saving_s": saving,
            "min_saving_s": min(diffs) if diffs else None,
            "max_saving_s": max(diffs) if diffs else None,
            "saving_of_medians_s": (
                round(median(list(off.values())) - median(list(on.values())), 3) if off and on else None
            ),
            "paired_s": diffs,
            "keep": None if saving is None or part == "all" else saving >= FAST_START_KEEP_S,
        }
    return savings


#: (numerator, denominator, target, comparison) for each ratio the issue asks about.
RATIOS = [
    ("hook_distributed", "torchrun", 2.0, "<="),
    ("hook_connect", "torchrun", 1.3, "<="),
    ("hook_connect", "hook_distributed", None, ""),
    ("hook_distributed", "pyspark_distributed", 0.45, "<="),
    ("hook_local", "torchrun", 1.10, "<="),
    ("dag_distributed", "torchrun", 2.0, "<="),
    ("dag_distributed", "pyspark_distributed", 0.45, "<="),
    ("dag_local", "torchrun", 1.30, "<="),
    ("pyspark_local", "torchrun", None, ""),
    ("pyspark_distributed", "torchrun", None, ""),
    ("spark_empty", "torchrun", None, ""),
    # The lifeline's launch cost (the run-lifetime issue: within noise): supervised vs in-process.
    ("hook_supervised", "hook_distributed", None, ""),
    ("hook_supervised", "torchrun", 1.5, "<="),
    ("hook_supervised_local", "torchrun", 1.10, "<="),
    ("hook_supervised_local", "hook_local", None, ""),
    ("hook_local", "hook_local@base", None, ""),
    ("hook_distributed", "hook_distributed@base", None, ""),
    ("ray_cold", "torchrun", None, ""),
    ("ray_warm", "torchrun", None, ""),
    ("hook_supervised", "ray_warm", None, ""),
    ("hook_local@base", "torchrun", None, ""),
    ("hook_distributed@base", "torchrun", None, ""),
]


#: (variant, target): the time inside the call (``hook.run``, or ``start_run`` + ``follow``) over
#: raw torchrun's whole process. That is what a task waits for: Airflow forks its task processes
#: with Airflow imported, and they end with ``os._exit``; raw torchrun has no such split.
INNER_RATIOS = [
    ("hook_supervised", 1.5),
    ("hook_supervised_local", 1.10),
    ("hook_local", 1.10),
    ("hook_distributed", None),
    ("hook_connect", None),
    ("hook_supervised@base", None),
    ("hook_supervised_local@base", None),
]


def _judged(value: float, base: float, target: float | None) -> dict[str, Any]:
    """``value / base`` (3 places), against ``target`` (``<=``; None: no target)."""
    ratio = round(value / base, 3)
    return {"ratio": ratio, "target": target, "met": None if target is None else ratio <= target}


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians (and min/max) of the counted samples; ratios of medians against the targets."""
    stats: dict[str, Any] = {}
    for name, runs in samples.items():
        good = [s["wall_s"] for s in runs if s["ok"]]
        inner = [s["result"]["run_s"] for s in runs if s["ok"] and s.get("result") and "run_s" in s["result"]]
        stats[name] = {
            "median_s": median(good),
            "min_s": min(good) if good else None,
            "max_s": max(good) if good else None,
            "n_ok": len(good),
            "n": len(runs),
            "median_inner_run_s": median(inner),
        }
    median_s = {name: st["median_s"] for name, st in stats.items()}
    ratios = [
        {"numerator": num, "denominator": den, **_judged(median_s.get(num), median_s.get(den), target)}
        for num, den, target, _op in RATIOS
        if median_s.get(num) and median_s.get(den)
    ]
    # Inside the call, over raw torchrun's whole process.
    inner_ratios = [
        {"variant": name, **_judged(stats[name]["median_inner_run_s"], median_s.get("torchrun"), target)}
        for name, target in INNER_RATIOS
        if stats.get(name, {}).get("median_inner_run_s") and median_s.get("torchrun")
    ]
    return {"stats": stats, "ratios": ratios, "inner_ratios": inner_ratios}


def start_ray_head() -> str:
    """``ray start --head`` on 127.0.0.1 (no dashboard); returns its address."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray = RAY_PYTHON.parent / "ray"
    subprocess.run(
        [
            str(ray),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env={**bench_env(None), **RAY_ENV},
        check=True,
        capture_output=True,
    )
    return f"127.0.0.1:{port}"


def stop_ray_head() -> None:
    """``ray stop``: every process of the bench's Ray cluster."""
    subprocess.run([str(RAY_PYTHON.parent / "ray"), "stop", "--force"], check=False, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="one counted round (for development)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these variants")
    parser.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up round")
    parser.add_argument("--no-save", action="store_true", help="print only: leave latest.json and the docs")
    parser.add_argument("--baseline", metavar="REV", help="also run the hook variants at git revision REV")
    parser.add_argument(
        "--fast-start", action="store_true", help="what each part of fast_start.py saves (section fast_start)"
    )
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    pool = fast_start_variants() if args.fast_start else VARIANTS
    variants = [v for v in pool if not args.only or v.name in args.only]
    tree = None
    if args.baseline:
        tree = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=REPO, check=True)
        # Compiled as scripts/install compiles this checkout: with PYTHONDONTWRITEBYTECODE set (the
        # bench sets it), an uncompiled tree would pay for compiling every module in every process.
        subprocess.run(
            [PYTHON, "-m", "compileall", "-q", str(tree / "airflow_provider_torchdist")], check=True
        )
        variants += [
            v
            for v in baseline_variants(args.baseline, tree)
            if v.name.split("@")[0] in {x.name for x in variants}
        ]
    machine = machine_info()
    log(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['mem_gib']} GiB")
    home = make_airflow_home()
    env = bench_env(home)
    server = None
    if any(v.name == "hook_connect" for v in variants):
        server = start_connect_server()  # warm across rounds, as a shared Connect server is
        env[f"AIRFLOW_CONN_{CONNECT_CONN_ID.upper()}"] = json.dumps(
            {"conn_type": "spark_connect", "host": "127.0.0.1", "port": server.port}
        )
        log(f"Spark Connect server on {server.url}")
    ray_head = None
    if any(v.name.startswith("ray_") for v in variants):
        if not RAY_PYTHON.exists():
            log(f"no {RAY_PYTHON}: run `bash bench/ray-env` first; the Ray Train variants are left out")
            variants = [v for v in variants if not v.name.startswith("ray_")]
        elif any(v.name == "ray_warm" for v in variants):
            ray_head = os.environ[RAY_ADDRESS_ENV] = start_ray_head()
            log(f"Ray cluster head on {ray_head}")
    samples: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    warmup: dict[str, float] = {}
    try:
        schedule = ([0] if not args.no_warmup else []) + list(range(1, rounds + 1))
        for round_no in schedule:
            for variant in variants:
                sample = run_timed(variant.command(), {**env, **variant.env}, cwd=variant.cwd)
                ok = sample.rc == 0 and variant.check(sample.result)
                tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
                log(f"{tag} {variant.name}: {sample.wall_s:.2f} s{'' if ok else ' FAILED'}")
                if not ok:
                    print(sample.tail, file=sys.stderr)
                if round_no == 0:
                    warmup[variant.name] = sample.wall_s
                else:
                    samples[variant.name].append({"round": round_no, "ok": ok, **sample_dict(sample)})
    finally:
        if server is not None:
            server.stop()
        if ray_head is not None:
            stop_ray_head()
        shutil.rmtree(home, ignore_errors=True)
        if tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    summary = summarize(samples)
    for name, st in summary["stats"].items():
        log(f"{name:22s} median {st['median_s']} s (n={st['n_ok']}/{st['n']})")
    for r in summary["ratios"]:
        verdict = (
            "" if r["target"] is None else (" met" if r["met"] else " MISSED") + f" (target <= {r['target']})"
        )
        log(f"{r['numerator']} / {r['denominator']} = {r['ratio']}{verdict}")
    for r in summary["inner_ratios"]:
        verdict = (
            "" if r["target"] is None else (" met" if r["met"] else " MISSED") + f" (target <= {r['target']})"
        )
        log(f"inside the call: {r['variant']} / torchrun = {r['ratio']}{verdict}")
    if args.fast_start:
        summary["savings"] = fast_start_savings(samples)
        for part, sv in summary["savings"].items():
            log(
                f"fast start, {part} off: costs {sv['median_saving_s']} s "
                f"(min {sv['min_saving_s']}, max {sv['max_saving_s']}, per round {sv['paired_s']})"
            )
    ok = all(s["ok"] for runs in samples.values() for s in runs)
    if args.no_save:
        return 0 if ok else 1
    update_results(
        "fast_start" if args.fast_start else "launch",
        {
            "machine": machine,
            "rounds": rounds,
            "variants": {v.name: v.label for v in variants},
            "commands": {
                v.name: " ".join(Path(c).name if c.startswith("/") else c for c in v.command())
                for v in variants
            },
            **summary,
            "warmup_s": warmup,
            "samples": samples,
        },
    )
    from report import render_docs

    render_docs()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
