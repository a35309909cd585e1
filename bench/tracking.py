"""Experiment tracking on and off: steady-state training speed with and without ``mlflow_conn_id``.

Usage: ``python bench/tracking.py [--rounds 3] [--quick] [--steps 300] [--windows 5] [--no-save]``

A real MLflow tracking server (``mlflow server`` from ``./.venv-mlflow``, SQLite store, 127.0.0.1:
``tests/integration/mlflow_server.py``) is started once, before the rounds, and stopped by its
process group at the end. Then, interleaved after one uncounted warm-up round, the operator in
``dag.test()`` (``bench/workloads/dag_run.py``), local_mode=True, 2 ranks, training
``workloads/tracked_train.py``: the throughput benchmark's MLP with a ``report(loss=...)`` every
step, timing ``--windows`` windows of ``--steps`` steps after 30 warm-up steps inside the function
(launch excluded) and taking rank 0's median window:

- **off**: ``bench_tracking_off``, no MLflow connection;
- **on**: ``bench_tracking_on``, ``mlflow_conn_id`` naming the server (an ``AIRFLOW_CONN_`` variable
  of type ``mlflow``): the task logs every reported value to MLflow while the ranks train.

Reported: the median steps/s of each, on / off (goal: >= 0.99), the per-round on / off ratios, and,
read back with ``MlflowClient``, how many ``loss`` values each "on" run holds (every report, or the
variant did not provably track). Results go to the ``tracking`` section of ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.integration's MLflow server

from common import (  # noqa: E402
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

from tests.integration.mlflow_server import MlflowServer  # noqa: E402

#: Tracking on over off, steps/s (the issue's goal: within 1%).
GOAL = 0.99
#: The connection id of ``bench/dags/bench_tracking.py``'s "on" DAG.
CONN_ID = "bench_mlflow"
WARMUP_STEPS = 30
VARIANTS = {"off": "bench_tracking_off", "on": "bench_tracking_on"}


def group_cpu_s(pgid: int) -> float:
    """CPU seconds used by the processes of process group ``pgid`` (the MLflow server's: the server,
    its uvicorn worker, its job consumers), the ended children they waited for included."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields[0] is the state: utime is field 14 of stat(5)
            total += sum(int(x) for x in fields[11:15])
    return total / tick


def run_variant(
    name: str, env: dict[str, str], kwargs: dict[str, Any], out: Path, server_pgid: int
) -> dict[str, Any] | None:
    """One DAG run of the variant; rank 0's result and the CPU seconds the MLflow server used
    meanwhile (None when the run or the check failed)."""
    run_env = {**env, "BENCH_TRACKING_KWARGS": json.dumps({**kwargs, "out": str(out)})}
    server_cpu = group_cpu_s(server_pgid)
    sample = run_timed([PYTHON, str(WORKLOADS / "dag_run.py"), VARIANTS[name]], run_env, timeout=900)
    server_cpu = group_cpu_s(server_pgid) - server_cpu
    state = str((sample.result or {}).get("state", ""))
    if sample.rc != 0 or not state.endswith("success") or not out.exists():
        log(f"{name} FAILED (rc {sample.rc}, state {state or '?'}):\n{sample.tail}")
        return None
    value = json.loads(out.read_text())
    return {
        **value,
        "dag_run_s": round(sample.result["run_s"], 3),
        "wall_s": sample.wall_s,
        "load_before": sample.load_before,
        "server_cpu_s": round(server_cpu, 2),
    }


def logged_metrics(uri: str) -> list[dict[str, Any]]:
    """Every run of the "on" DAG's experiment: its status and how many ``loss`` values it holds."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(VARIANTS["on"])
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [
        {
            "run_id": run.info.run_id,
            "status": run.info.status,
            "loss_values": len(client.get_metric_history(run.info.run_id, "loss")),
        }
        for run in runs
    ]


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per variant; on / off of the medians, and per round (paired)."""
    stats = {
        name: {
            "median_steps_per_s": median([s["steps_per_s"] for s in runs]),
            "max_steps_per_s": round(max(s["steps_per_s"] for s in runs), 2) if runs else None,
            "median_dag_run_s": median([s["dag_run_s"] for s in runs]),
            "median_server_cpu_s": median([s["server_cpu_s"] for s in runs]),
            "n": len(runs),
        }
        for name, runs in samples.items()
    }
    on, off = stats["on"]["median_steps_per_s"], stats["off"]["median_steps_per_s"]
    by_round = {s["round"]: s["steps_per_s"] for s in samples["off"]}
    paired = [
        round(s["steps_per_s"] / by_round[s["round"]], 3) for s in samples["on"] if s["round"] in by_round
    ]
    ratio = round(on / off, 3) if on and off else None
    # Met only when the ratio of the medians and the median of the per-round ratios both reach the
    # goal: on a shared machine, load that drifts between rounds can make either look good alone.
    paired_median = median(paired)
    met = None if ratio is None or paired_median is None else min(ratio, paired_median) >= GOAL
    return {
        "stats": stats,
        "ratio": ratio,
        "paired_ratios": paired,
        "median_paired_ratio": paired_median,
        "goal": GOAL,
        "met": met,
    }


def run_rounds(
    env: dict[str, str], work: Path, rounds: int, kwargs: dict[str, Any], server_pgid: int
) -> dict[str, list]:
    """Warm-up, then ``rounds`` rounds of off, on; the counted samples per variant."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for round_no in range(0, rounds + 1):
        for name in VARIANTS:
            value = run_variant(name, env, kwargs, work / f"{name}-{round_no}.json", server_pgid)
            if value is None:
                continue
            tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
            log(
                f"{tag} {name}: {value['steps_per_s']:.1f} steps/s, dag.test() {value['dag_run_s']:.2f} s, "
                f"MLflow server CPU {value['server_cpu_s']:.2f} s"
            )
            if round_no:
                samples[name].append({"round": round_no, **value})
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round, 2 windows of 100 steps")
    parser.add_argument("--steps", type=int, default=300, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("mlflow") is None:
        parser.error('the MLflow client is not installed: pip install -e ".[mlflow]" (the "on" DAG needs it)')
    rounds, steps, windows = (1, 100, 2) if args.quick else (args.rounds, args.steps, args.windows)
    kwargs = {"steps": steps, "windows": windows, "warmup": WARMUP_STEPS}
    machine = machine_info()
    log(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['mem_gib']} GiB")
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    server = MlflowServer(work)
    try:
        server.start()
        log(f"MLflow tracking server on {server.uri}")
        env = bench_env(
            make_airflow_home(work),
            MLFLOW_DISABLE_TELEMETRY="true",
            **{f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({"conn_type": "mlflow", "host": server.uri})},
        )
        assert server.proc is not None  # started: it leads its process group
        samples = run_rounds(env, work, rounds, kwargs, server.proc.pid)
        runs = logged_metrics(server.uri)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(samples)
    expected = WARMUP_STEPS + windows * steps
    tracked = len(runs) == rounds + 1 and all(
        r["loss_values"] == expected and r["status"] == "FINISHED" for r in runs
    )
    for name, st in summary["stats"].items():
        log(f"{name:4s} median {st['median_steps_per_s']} steps/s (n={st['n']})")
    log(
        f"MLflow runs of the 'on' DAG: {[(r['status'], r['loss_values']) for r in runs]}, {expected} each expected"
    )
    verdict = "met" if summary["met"] else "MISSED"
    log(
        f"on / off steps/s = {summary['ratio']}, median per round {summary['median_paired_ratio']} "
        f"({verdict}, goal: both >= {GOAL}); per round {summary['paired_ratios']}"
    )
    if not args.no_save:
        update_results(
            "tracking",
            {
                "machine": machine,
                "rounds": rounds,
                "steps": steps,
                "windows": windows,
                "warmup_steps": WARMUP_STEPS,
                **summary,
                "mlflow_runs": runs,
                "expected_loss_values": expected,
                "tracked": tracked,
                "samples": samples,
            },
        )
        from report import render_docs

        render_docs()
    return 0 if summary["ratio"] is not None and tracked else 1


if __name__ == "__main__":
    sys.exit(main())
