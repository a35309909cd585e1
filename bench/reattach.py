"""Kill to reattach: from the owner of a durable run being SIGKILLed to a new owner reattached.

Usage: ``python bench/reattach.py [--rounds 3] [--quick]``

Each round starts a durable distributed run of ``workloads/gated_fn.py`` (2 ranks, embedded
master) from ``workloads/first_owner.py``, which follows it as a task process would. Once both
ranks are training (their marker files, never a sleep) the benchmark SIGKILLs that process and
at once starts ``workloads/retry_owner.py``: a fresh interpreter, as a retried task is, that
imports the hook, reads the record and follows the run. "Reattached" is the first replayed log
line reaching the new owner (lifeline up, authenticated both ways). The retry then opens the gate
and must get rank 0's value from the one run.

Baseline, in the same run: from spawning a fresh interpreter to its having imported the hook, the
floor of any retry. What Airflow adds in a real deployment (noticing the dead try, ``retry_delay``, starting
the next try) comes on top and is not ours to measure here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import PYTHON, REPO, WORKLOADS, bench_env, log, machine_info, median, run_timed, update_results

IMPORT_ONLY = (
    "import time, json; import airflow_provider_torchdist.hooks.torch_distributor; "
    "print('RESULT ' + json.dumps({'t_imported': time.time()}))"
)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


def one_round(env: dict[str, str], tmp: Path) -> dict[str, Any] | None:
    gate = tmp / "gate"
    gate.mkdir()
    record = tmp / "record.json"
    first = subprocess.Popen(
        [PYTHON, str(WORKLOADS / "first_owner.py"), str(gate), str(record)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "first_owner.log", "w"),  # noqa: SIM115 (closed with the process)
    )
    try:
        _wait(
            lambda: record.exists() and all((gate / f"training-{r}").exists() for r in (0, 1)),
            300,
            "both ranks to train",
        )
    except TimeoutError:
        first.kill()
        first.wait()
        log((tmp / "first_owner.log").read_text()[-3000:])
        raise
    os.kill(first.pid, signal.SIGKILL)
    killed = time.time()
    first.wait()
    sample = run_timed([PYTHON, str(WORKLOADS / "retry_owner.py"), str(record), str(gate)], env)
    if sample.rc != 0 or not sample.result or sample.result.get("t_reattached") is None:
        log(f"retry FAILED:\n{sample.tail}")
        return None
    result = sample.result
    return {
        "kill_to_reattached_s": round(result["t_reattached"] - killed, 3),
        "process_start_s": round(result["t_start"] - killed, 3),
        "start_to_reattached_s": round(result["t_reattached"] - result["t_start"], 3),
        "reattached_to_value_s": round(result["t_done"] - result["t_reattached"], 3),
        "load_before": sample.load_before,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    samples: list[dict[str, Any]] = []
    baseline: list[float] = []
    for round_no in range(0, rounds + 1):
        tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
        spawned = time.time()
        base = run_timed([PYTHON, "-c", IMPORT_ONLY], env)
        floor_s = round(base.result["t_imported"] - spawned, 3) if base.result else None
        with tempfile.TemporaryDirectory(prefix="bench-reattach-") as tmp:
            sample = one_round(env, Path(tmp))
        if sample is None:
            continue
        log(
            f"{tag}: reattached {sample['kill_to_reattached_s']:.2f} s after the kill "
            f"(spawn to imported, nothing else: {floor_s} s)"
        )
        if round_no:
            samples.append({**sample, "import_only_s": floor_s})
            if floor_s is not None:
                baseline.append(floor_s)
    reattach = median([s["kill_to_reattached_s"] for s in samples])
    floor = median(baseline)
    stats = {
        "kill_to_reattached_median_s": reattach,
        "import_only_median_s": floor,
        "ratio_to_import_only": round(reattach / floor, 2) if reattach and floor else None,
        "reattached_to_value_median_s": median([s["reattached_to_value_s"] for s in samples]),
        "n": len(samples),
    }
    log(json.dumps(stats))
    update_results(
        "reattach", {"machine": machine_info(), "rounds": rounds, "stats": stats, "samples": samples}
    )
    from report import render_docs

    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
