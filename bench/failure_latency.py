"""Failure latency: from a rank raising to ``hook.run`` raising in the caller.

Usage: ``python bench/failure_latency.py [--rounds 3] [--quick]``

Rank 1 writes ``time.time()`` to a file just before it raises while rank 0 blocks in a barrier
(``workloads/fail_fn.py``); ``workloads/hook_fail.py`` notes when ``hook.run`` raised, which is
after spark-submit and every process of the run have exited. Both modes, interleaved, after an
uncounted warm-up round. Target: <= 3 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import PYTHON, WORKLOADS, bench_env, log, machine_info, median, run_timed, update_results

TARGET_S = 3.0
MODES = ("local", "distributed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-fail-") as tmp:
        for round_no in range(0, rounds + 1):
            for mode in MODES:
                stamp = Path(tmp) / f"{mode}-{round_no}.txt"
                sample = run_timed([PYTHON, str(WORKLOADS / "hook_fail.py"), f"--{mode}", str(stamp)], env)
                result = sample.result
                if sample.rc != 0 or not result:
                    log(f"{mode} FAILED:\n{sample.tail}")
                    continue
                latency = result["t_hook_raised"] - result["t_rank_raised"]
                tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
                log(f"{tag} {mode}: {latency:.2f} s from rank 1 raising to hook.run raising")
                if round_no:
                    samples[mode].append(
                        {
                            "latency_s": round(latency, 3),
                            "run_wall_s": sample.wall_s,
                            "error": result["error"][:300],
                            "load_before": sample.load_before,
                        }
                    )
    stats = {}
    for mode, runs in samples.items():
        lat = [r["latency_s"] for r in runs]
        med = median(lat)
        stats[mode] = {
            "median_s": med,
            "max_s": max(lat) if lat else None,
            "n": len(lat),
            "target_s": TARGET_S,
            "met": med is not None and med <= TARGET_S,
        }
        log(f"{mode}: median {med} s, max {stats[mode]['max_s']} s (target <= {TARGET_S} s)")
    update_results(
        "failure_latency", {"machine": machine_info(), "rounds": rounds, "stats": stats, "samples": samples}
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
