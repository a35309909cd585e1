"""Steady-state training speed: raw torchrun vs. the same function through the hook.

Usage: ``python bench/throughput.py [--rounds 3] [--quick]``

The workload (``workloads/mlp_train.py``) times its own steps after warm-up steps, inside the
training function, so launch overhead is excluded; rank 0 returns steps/s and the thread
settings every rank saw (``OMP_NUM_THREADS``, ``torch.get_num_threads()``). Variants run
interleaved, one uncounted warm-up round first. Target: hook / torchrun >= 0.97, in local mode,
distributed mode with one rank per Spark task, and two ranks in one Spark task (``nproc_per_node=2``,
where Spark's ``OMP_NUM_THREADS=spark.task.cpus`` is split between the ranks). Every hook variant
runs with the hang watchdog on (the default ``hang_timeout``); ``bench/watchdog.py`` measures it on
and off.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common import BIN, PYTHON, WORKLOADS, bench_env, log, machine_info, median, run_timed, update_results

TARGET = 0.97

HOOK = [PYTHON, str(WORKLOADS / "hook_call.py"), "mlp_train:train_mlp"]

VARIANTS: dict[str, list[str]] = {
    "torchrun": [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        str(WORKLOADS / "mlp_train.py"),
    ],
    "hook_distributed": [*HOOK, "--distributed"],
    "hook_local": [*HOOK, "--local"],
    # one Spark task running both ranks: spark.task.cpus=2, and Spark's own OMP_NUM_THREADS for it
    "hook_distributed_nproc2": [*HOOK, "--distributed", "--nproc-per-node", "2"],
}


def _value(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if not result:
        return None
    return result.get("value", result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    for round_no in range(0, rounds + 1):
        for name, cmd in VARIANTS.items():
            sample = run_timed(cmd, env)
            value = _value(sample.result)
            if sample.rc != 0 or not value:
                log(f"{name} FAILED:\n{sample.tail}")
                continue
            tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
            log(
                f"{tag} {name}: {value['steps_per_s']:.1f} steps/s (OMP_NUM_THREADS={value['omp_num_threads_env']}, "
                f"torch threads {value['torch_num_threads']})"
            )
            if round_no:
                samples[name].append({**value, "load_before": sample.load_before, "wall_s": sample.wall_s})
    stats: dict[str, Any] = {}
    for name, runs in samples.items():
        rates = [r["steps_per_s"] for r in runs]
        stats[name] = {
            "median_steps_per_s": median(rates),
            "max_steps_per_s": round(max(rates), 2) if rates else None,
            "omp_num_threads_env": sorted({str(r["omp_num_threads_env"]) for r in runs}),
            "torch_num_threads": sorted({r["torch_num_threads"] for r in runs}),
            "n": len(runs),
        }
    base = stats["torchrun"]["median_steps_per_s"]
    ratios = {}
    for name in VARIANTS:
        if name != "torchrun" and base and stats[name]["median_steps_per_s"]:
            ratio = round(stats[name]["median_steps_per_s"] / base, 3)
            ratios[name] = {"ratio": ratio, "target": TARGET, "met": ratio >= TARGET}
            log(f"{name} / torchrun = {ratio} ({'met' if ratio >= TARGET else 'MISSED'}, target >= {TARGET})")
    update_results(
        "throughput",
        {"machine": machine_info(), "rounds": rounds, "stats": stats, "ratios": ratios, "samples": samples},
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
