"""Output round trip: a 100 MiB state_dict from rank 0 to the caller, vs. torch.save + torch.load.

Usage: ``python bench/output_roundtrip.py [--rounds 3] [--quick] [--mb 100]``

Per mode and round, three runs through the hook (``workloads/hook_output.py``), interleaved:

- ``return``: rank 0 returns the state_dict; the caller does what the operator does with it
  (``output_to_xcom`` with the default 4 MiB inline limit: above it, the pickle is stored at an
  ``output_path`` on the staging directory's filesystem and XCom gets a signed reference), then
  ``load_output`` of that XCom value, as a downstream task would;
- ``tiny``: the same with an empty output, for the launch's own tail (rank exit, driver, JVM);
- ``save``: rank 0 ``torch.save``s it to local disk; the caller ``torch.load``s it (baseline).

Time of the data path: rank 0 returning until the driver has written its value (the output
file's mtime), plus ``output_to_xcom`` and ``load_output`` in the caller; against ``torch.save`` in rank
0 plus ``torch.load`` in the caller (``data_ratio``, target <= 2x). ``e2e_ratio`` compares the two
whole paths from rank 0's return (or save) until the caller holds the object, including the
launch's shared tail (driver, JVM and process exits).
Memory: peak RSS (``VmHWM``) of rank 0 and of the caller, above the tiny run's, over the output's
size. Target: <= 2.5x.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from common import PYTHON, WORKLOADS, bench_env, log, machine_info, median, run_timed, update_results

TIME_TARGET = 2.0
RSS_TARGET = 2.5
MODES = ("local", "distributed")


def one(mode: str, how: str, mb: int, env: dict[str, str]) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="bench-output-") as tmp:
        cmd = [
            PYTHON,
            str(WORKLOADS / "hook_output.py"),
            f"--{mode}",
            "--mb",
            str(mb),
            "--how",
            how,
            "--dir",
            tmp,
        ]
        sample = run_timed(cmd, env)
        if sample.rc != 0 or not sample.result:
            log(f"{mode} {how} {mb} MiB FAILED:\n{sample.tail}")
            return None
        return {**sample.result, "load_before": sample.load_before}


def derive(ret: dict[str, Any], tiny: dict[str, Any], save: dict[str, Any]) -> dict[str, Any]:
    """The numbers one round gives: seconds, ratios, and peak RSS over the output size."""
    size = ret["output_bytes"]
    ret_e2e = ret["t_loaded"] - ret["t_return"]
    tiny_e2e = tiny["t_loaded"] - tiny["t_return"]
    save_e2e = save["t_loaded"] - save["t_before_save"]
    save_load = (save["t_saved"] - save["t_before_save"]) + (save["t_loaded"] - save["t_load_start"])
    kib = 1024
    to_xcom = ret["t_to_xcom"] - ret["t_got_pickled"]
    load = ret["t_loaded"] - ret["t_load_start"]
    data_path = (ret["t_output_landed"] - ret["t_return"]) + to_xcom + load

    def over(a: int, b: int) -> float:
        return round((a - b) * kib / size, 2)

    return {
        "output_mib": round(size / 2**20, 1),
        "xcom_json_mib": round(ret["xcom_json_chars"] / 2**20, 1),
        "return_e2e_s": round(ret_e2e, 3),
        "tiny_e2e_s": round(tiny_e2e, 3),
        "save_e2e_s": round(save_e2e, 3),
        "save_plus_load_s": round(save_load, 3),
        "return_extra_s": round(ret_e2e - tiny_e2e, 3),
        "by_reference": ret.get("by_reference"),
        "to_xcom_s": round(to_xcom, 3),
        "load_output_s": round(load, 3),
        "rank_to_caller_s": round(ret["t_got_pickled"] - ret["t_return"], 3),
        "rank_to_driver_s": round(ret["t_output_landed"] - ret["t_return"], 3),
        "data_path_s": round(data_path, 3),
        "data_ratio": round(data_path / save_load, 2),
        "e2e_ratio": round(ret_e2e / save_e2e, 2),
        "rank0_peak_mib": round(ret["peak_rss_kib"].get("rank0", 0) / kib, 1),
        "rank0_peak_tiny_mib": round(tiny["peak_rss_kib"].get("rank0", 0) / kib, 1),
        "rank0_rss_over_output": over(
            ret["peak_rss_kib"].get("rank0", 0), tiny["peak_rss_kib"].get("rank0", 0)
        ),
        "rank0_rss_over_output_save": over(
            save["peak_rss_kib"].get("rank0", 0), tiny["peak_rss_kib"].get("rank0", 0)
        ),
        "driver_peak_mib": round(ret["driver_peak_rss_kib"] / kib, 1),
        "caller_rss_over_output": over(ret["parent_hwm_after_kib"], ret["parent_hwm_before_kib"]),
        "caller_rss_over_output_save": over(save["parent_hwm_after_kib"], save["parent_hwm_before_kib"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--mb", type=int, default=100, help="output size, MiB (default 100)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for round_no in range(1, rounds + 1):
        for mode in MODES:
            ret, tiny, save = (
                one(mode, "return", args.mb, env),
                one(mode, "return", 0, env),
                one(mode, "save", args.mb, env),
            )
            if not (ret and tiny and save):
                continue
            row = derive(ret, tiny, save) | {"load_before": ret["load_before"]}
            samples[mode].append(row)
            log(
                f"round {round_no}/{rounds} {mode}: data path {row['data_path_s']:.2f} s vs save+load "
                f"{row['save_plus_load_s']:.2f} s (x{row['data_ratio']}); e2e x{row['e2e_ratio']}; "
                f"rank 0 RSS +{row['rank0_rss_over_output']}x, "
                f"caller +{row['caller_rss_over_output']}x of the output"
            )
    stats: dict[str, Any] = {}
    for mode, rows in samples.items():
        if not rows:
            continue
        stats[mode] = {
            key: median([r[key] for r in rows])
            for key in rows[0]
            if key not in ("load_before", "by_reference")
        }
        stats[mode]["by_reference"] = all(r["by_reference"] for r in rows)
        stats[mode]["n"] = len(rows)
        stats[mode]["time_met"] = stats[mode]["data_ratio"] <= TIME_TARGET
        stats[mode]["rank_rss_met"] = stats[mode]["rank0_rss_over_output"] <= RSS_TARGET
        stats[mode]["caller_rss_met"] = stats[mode]["caller_rss_over_output"] <= RSS_TARGET
    update_results(
        "output_roundtrip",
        {
            "machine": machine_info(),
            "rounds": rounds,
            "mb": args.mb,
            "targets": {"time_ratio": TIME_TARGET, "rss_over_output": RSS_TARGET},
            "stats": stats,
            "samples": samples,
        },
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
