"""Steady state: a small transformer LM trained through the operator's path against raw torchrun.

Usage: ``python bench/steady_state.py [--rounds 3] [--quick] [--steps 200] [--batch 16] [--no-save]``

A synthetic token set (``tokens``: fixed-size lists of 128 int32 tokens, enough rows for every
rank's steps, two Parquet files) is written once. Then, interleaved after an uncounted warm-up:

- **torchrun**: ``torchrun --standalone --nproc_per_node=2 workloads/lm_train.py``, each rank
  reading its half of the files itself (pyarrow, local disk);
- **operator path**: ``workloads/lm_hook.py``: ``TorchDistributorHook(train_data="SELECT tokens
  FROM parquet.`DIR`")`` with ``start_run`` + ``follow`` (the detached supervisor and its lifeline,
  as the operator runs it), local_mode=False on the embedded master, each rank reading its shard
  with ``rank_batches``; the hang watchdog on (the default ``hang_timeout``);
- **operator path, watchdog off**: the same with ``hang_timeout=None``.

All train the same model for ``--steps`` steps (``workloads/lm_train.py``). Reported per variant:
tokens per second after the first 10 steps (all ranks together) and the time from the launcher's
fork to the end of rank 0's first step. The goal: the operator path at >= 0.97x raw torchrun's
tokens/s, watchdog on; and the watchdog's own cost, on / off, as the median of each round's paired
ratio (a machine whose load drifts between rounds moves a paired ratio less). Results go to the ``steady_state`` section of ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BIN,
    PYTHON,
    WORKLOADS,
    bench_env,
    log,
    machine_info,
    make_airflow_home,
    median,
    run_timed,
    update_results,
)

SEQ = 128
VOCAB = 4096
#: The operator path's tokens/s against raw torchrun's (the issue's goal).
GOAL = 0.97
#: The operator path's tokens/s with the hang watchdog on against off.
WATCHDOG_GOAL = 0.99


def write_tokens(directory: Path, rows: int, seed: int = 0) -> None:
    """``rows`` sequences of ``SEQ`` random tokens, as two Parquet files of a fixed-size list column."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    half = rows // 2
    for part, count in enumerate((half, rows - half)):
        flat = pa.array(rng.integers(0, VOCAB, size=count * SEQ, dtype=np.int32))
        column = pa.FixedSizeListArray.from_arrays(flat, SEQ)
        pq.write_table(pa.table({"tokens": column}), directory / f"part-{part}.parquet")


def paired_ratios(samples: dict[str, list[dict[str, Any]]], top: str, bottom: str) -> dict[str, Any]:
    """``top`` / ``bottom`` tokens/s in each round both ran: the rounds' ratios and their median."""
    by_round = {s["round"]: s["tokens_per_s"] for s in samples.get(bottom, [])}
    ratios = [
        round(s["tokens_per_s"] / by_round[s["round"]], 3)
        for s in samples.get(top, [])
        if by_round.get(s["round"])
    ]
    return {"rounds": ratios, "median": median(ratios)}


def variants(data: Path, steps: int, batch: int) -> dict[str, list[str]]:
    args = ["--data", str(data), "--steps", str(steps), "--batch", str(batch)]
    return {
        "torchrun": [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            str(WORKLOADS / "lm_train.py"),
            *args,
        ],
        "operator_path": [PYTHON, str(WORKLOADS / "lm_hook.py"), *args],
        "operator_path_watchdog_off": [PYTHON, str(WORKLOADS / "lm_hook.py"), *args, "--hang-timeout", "0"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round, 40 steps (for development)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    rounds, steps = (1, 40) if args.quick else (args.rounds, args.steps)
    machine = machine_info()
    log(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['mem_gib']} GiB")
    work = Path(tempfile.mkdtemp(prefix="bench-steady-"))
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        data = work / "tokens"
        data.mkdir()
        rows = 2 * args.batch * (steps + 5)  # every rank's steps, and a little over
        write_tokens(data, rows)
        log(f"{rows} sequences of {SEQ} tokens in {data}")
        env = bench_env(make_airflow_home(work))
        commands = variants(data, steps, args.batch)
        samples = {name: [] for name in commands}
        for round_no in [0, *range(1, rounds + 1)]:
            for name, command in commands.items():
                forked = time.time()
                sample = run_timed(command, env, timeout=1800)
                value = (sample.result or {}).get("value") or {}
                ok = sample.rc == 0 and value.get("steps") == steps and value.get("tokens_per_s")
                tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
                if not ok:
                    log(f"{tag} {name}: FAILED\n{sample.tail}")
                    continue
                first_step_s = value["first_step_at"] - forked
                log(
                    f"{tag} {name}: {value['tokens_per_s']:.0f} tokens/s, first step after {first_step_s:.2f} s, wall {sample.wall_s:.2f} s"
                )
                if round_no:
                    samples[name].append(
                        {
                            "round": round_no,
                            "tokens_per_s": value["tokens_per_s"],
                            "first_step_s": first_step_s,
                            "wall_s": sample.wall_s,
                            "loss": value["loss"],
                        }
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats = {
        name: {
            "median_tokens_per_s": median([s["tokens_per_s"] for s in runs]),
            "median_first_step_s": median([s["first_step_s"] for s in runs]),
            "median_wall_s": median([s["wall_s"] for s in runs]),
            "n": len(runs),
        }
        for name, runs in samples.items()
    }
    ours, raw = stats["operator_path"]["median_tokens_per_s"], stats["torchrun"]["median_tokens_per_s"]
    ratio = round(ours / raw, 3) if ours and raw else None
    watchdog = paired_ratios(samples, "operator_path", "operator_path_watchdog_off")
    log(f"watchdog on / off, paired per round: {watchdog}")
    for name, st in stats.items():
        log(
            f"{name:14s} {st['median_tokens_per_s']} tokens/s, first step {st['median_first_step_s']} s (n={st['n']})"
        )
    log(
        f"operator_path / torchrun tokens/s = {ratio} ({'met' if ratio and ratio >= GOAL else 'MISSED'}, goal >= {GOAL})"
    )
    if not args.no_save:
        update_results(
            "steady_state",
            {
                "machine": machine,
                "steps": steps,
                "batch": args.batch,
                "seq": SEQ,
                "rounds": rounds,
                "stats": stats,
                "ratio_tokens_per_s": ratio,
                "goal": GOAL,
                "watchdog_on_off": {**watchdog, "goal": WATCHDOG_GOAL},
                "samples": samples,
            },
        )
    return 0 if ratio is not None else 1


if __name__ == "__main__":
    sys.exit(main())
