"""The hang watchdog's cost on a healthy run: steady-state steps/s with it on and off.

Usage: ``python bench/watchdog.py [--rounds 7] [--quick]``

The throughput benchmark's workload (``workloads/mlp_train.py``: it times its own steps after
warm-up, so launch overhead is excluded) through the hook in local mode, 2 ranks, with the
watchdog on (the default ``hang_timeout``: every rank samples its main thread twice a second and
reports every 2 s) and off (``hang_timeout=None``), beside raw torchrun. The three run interleaved
after one uncounted warm-up round; each round gives paired ratios (on / off, on / torchrun), and
the figures are their medians, which a machine whose load drifts between rounds disturbs less than
a ratio of medians. Goal: on / torchrun >= 0.97 (the throughput benchmark's), on / off >= 0.99.
Results go to the ``watchdog`` section of ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common import BIN, PYTHON, WORKLOADS, bench_env, log, machine_info, median, run_timed, update_results

GOALS = {"on/torchrun": 0.97, "on/off": 0.99}
HOOK = [PYTHON, str(WORKLOADS / "hook_call.py"), "mlp_train:train_mlp", "--local"]
VARIANTS: dict[str, list[str]] = {
    "torchrun": [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        str(WORKLOADS / "mlp_train.py"),
    ],
    "on": HOOK,
    "off": [*HOOK, "--hang-timeout", "0"],
}


def one_round(env: dict[str, str]) -> dict[str, dict[str, Any]] | None:
    """Each variant once; None when one failed (the round is not counted)."""
    found = {}
    for name, cmd in VARIANTS.items():
        sample = run_timed(cmd, env)
        value = (sample.result or {}).get("value", sample.result)
        if sample.rc != 0 or not value:
            log(f"{name} FAILED:\n{sample.tail}")
            return None
        found[name] = {"steps_per_s": value["steps_per_s"], "load_before": sample.load_before}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one counted round, not saved")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    counted: list[dict[str, dict[str, Any]]] = []
    for round_no in range(rounds + 1):
        found = one_round(env)
        if found is None:
            continue
        rates = {name: f["steps_per_s"] for name, f in found.items()}
        log(f"{'warm-up' if round_no == 0 else f'round {round_no}/{rounds}'}: {rates} steps/s")
        if round_no:
            counted.append(found)
    pairs = {
        "on/torchrun": [r["on"]["steps_per_s"] / r["torchrun"]["steps_per_s"] for r in counted],
        "on/off": [r["on"]["steps_per_s"] / r["off"]["steps_per_s"] for r in counted],
    }
    ratios = {}
    for name, values in pairs.items():
        ratio = median(values)
        ratios[name] = {
            "median": ratio,
            "goal": GOALS[name],
            "met": ratio is not None and ratio >= GOALS[name],
        }
        log(f"{name}: median of {len(values)} paired ratios = {ratio} (goal >= {GOALS[name]})")
    if args.quick:
        return 0
    stats = {name: median([r[name]["steps_per_s"] for r in counted]) for name in VARIANTS}
    update_results(
        "watchdog",
        {
            "machine": machine_info(),
            "rounds": len(counted),
            "median_steps_per_s": stats,
            "ratios": ratios,
            "samples": counted,
        },
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
