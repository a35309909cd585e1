"""Spark data into training: ``train_data=`` against PySpark's private path and doing it yourself.

Usage: ``python bench/data_path.py [--rounds 3] [--quick] [--gb 2] [--variants ours,a,b]
[--data-dir DIR] [--no-save] [--cluster]``

A data set of numeric columns (``id`` bigint, 16 float features, an int ``label``: 76 bytes a row
as Arrow) of ``--gb`` GB as Arrow, generated once with Spark as Parquet (``--data-dir`` keeps it
for the next run). Every variant reads it with the same query, ``SELECT * FROM parquet.`DIR```,
on the embedded ``local[2]`` master, 2 ranks, and every rank iterates all its rows as tensors in
batches of 65,536, summing each tensor (``bench/workloads/data_rank.py``):

- **ours**: ``TorchDistributorHook(num_processes=2, train_data=query).run(fn)``, ``fn`` iterating
  ``rank_batches``; timed from the ``hook.run`` call to its return.
- **a**: PySpark's ``TorchDistributor(num_processes=2, local_mode=False)._train_on_dataframe`` with
  ``_get_spark_partition_data_loader`` (the query repartitioned to 2, as that path requires), in a
  spark-submit'ed ``local[2]`` application; timed from the spark-submit fork to
  ``_train_on_dataframe``'s return.
- **connect**: ``ours`` over a ``spark_connect`` connection to a warm ``local[2]`` Connect server
  (started by this script): the query runs on the server's session, and its shuffle brings the
  rows to the ranks on its executors. Also the peak RSS of the task's process and of its Connect
  driver (goal: flat, under 512 MB, whatever ``--gb``).
- **b**: do it yourself: spark-submit writes the query's result as Parquet, then ``hook.run(fn)``
  with rank r reading the sorted files ``files[r::2]`` with pyarrow; timed from the spark-submit
  fork to ``hook.run``'s return.

``--cluster``: the same on a two-host netns cluster (two Workers of one core, each in a network
namespace of its own; the driver stays on the bridge), whose hosts share this machine's filesystem,
so the connection declares a ``shared-dir``. Variants: **ours** (the connection as configured: the
tasks write the rows into the shared directory, the ranks map them), **shuffle** (ours with
``spark.torchdist.trainData.route=shuffle``: the rows travel by Spark's shuffle to each node's
barrier task, the route a cluster without a shared directory takes) and **b** (the Parquet written
into a shared directory by a spark-submit on the cluster). Saved as the ``data_path_cluster`` section.

Interleaved rounds after an uncounted warm-up round. Goals: ours >= 2x (a) and >= 1.0x (b) in
throughput; a delivered shard iterated at >= 1 GB/s by the rank; peak ``RssAnon`` per rank
<= 1.5 GB. Results go to the ``data_path`` section of ``bench/results/latest.json`` unless
``--no-save`` (for trying a variant or a small ``--gb``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    PYTHON,
    WORKLOADS,
    bench_env,
    log,
    machine_info,
    median,
    run_timed,
    spark_submit_cmd,
    update_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.integration's Connect server
from tests.integration.connect_server import start_connect_server  # noqa: E402

BATCH_SIZE = 65536
NUM_PROCESSES = 2
ROW_BYTES = 8 + 16 * 4 + 4  # id bigint, 16 float features, int label: as Arrow, no nulls
VARIANTS = {
    "ours": "`train_data=` + `rank_batches`",
    "connect": "`train_data=` + `rank_batches` over Spark Connect (a `local[2]` server)",
    "a": "(a) PySpark `_train_on_dataframe` + `_get_spark_partition_data_loader`",
    "b": "(b) Spark writes Parquet, ranks read their files with pyarrow",
}
CLUSTER_VARIANTS = {
    "ours": "`train_data=` + `rank_batches`, the connection's `shared-dir` (the tasks write the rows there)",
    "shuffle": "`train_data=` + `rank_batches` by Spark's shuffle (`spark.torchdist.trainData.route=shuffle`)",
    "b": "(b) spark-submit on the cluster writes Parquet to a shared directory, ranks read their files with pyarrow",
}
RATIO_GOALS = {"a": 2.0, "b": 1.0}  # ours' throughput over the variant's, at least
#: The netns cluster of ``--cluster`` (its own names and subnet: it may run beside the tests' ones).
CLUSTER_PREFIX, CLUSTER_SUBNET = "tdbd", "10.231.98"
CLUSTER_CONN_ID = "bench_data_cluster"
ITER_GOAL_GB_S = 1.0
RSS_GOAL_MB = 1.5 * 1024
#: The bench's ``spark_connect`` connection (an AIRFLOW_CONN_ variable naming the warm server).
CONNECT_CONN_ID = "bench_data_connect"
#: The Connect client's (the task's process, and its Connect driver's) peak RSS, at any data size.
CLIENT_RSS_GOAL_MB = 512


def dataset(directory: Path, gb: float, env: dict[str, str]) -> dict[str, Any]:
    """The Parquet data set in ``directory``: reused when it has the rows asked for, else generated."""
    rows = int(gb * 1e9 / ROW_BYTES) // NUM_PROCESSES * NUM_PROCESSES
    meta_file = directory / "dataset.json"
    parquet = directory / "parquet"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        if meta["rows"] == rows and (parquet / "_SUCCESS").exists():
            log(f"reusing the data set in {parquet}: {rows:,} rows")
            return meta
    shutil.rmtree(parquet, ignore_errors=True)
    log(f"generating {rows:,} rows ({rows * ROW_BYTES / 1e9:.2f} GB as Arrow) as Parquet in {parquet}")
    cmd = spark_submit_cmd(WORKLOADS / "data_spark.py", "generate", str(parquet), str(rows))
    sample = run_timed(cmd, env, timeout=3600)
    if sample.rc != 0 or not sample.result:
        raise RuntimeError(f"generating the data set failed:\n{sample.tail}")
    files = sorted(parquet.glob("*.parquet"))
    meta = {
        "rows": rows,
        "columns": sample.result["columns"],
        "row_bytes": ROW_BYTES,
        "arrow_bytes": rows * ROW_BYTES,
        "parquet_bytes": sum(f.stat().st_size for f in files),
        "parquet_files": len(files),
        "generate_s": round(sample.wall_s, 1),
    }
    meta_file.write_text(json.dumps(meta))
    return meta


def run_variant(
    name: str, query: str, rows: int, scratch: Path, env: dict[str, str], cluster: str | None = None
) -> dict[str, Any] | None:
    """One sample of one variant (on ``cluster``, data_hook.py's ``--cluster`` JSON); None when it
    failed (logged)."""
    on = ["--cluster", cluster] if cluster else []
    if name in ("ours", "shuffle", "connect"):
        cmd = [PYTHON, str(WORKLOADS / "data_hook.py"), name, query, str(BATCH_SIZE), *on]
        cmd += ["--conn-id", CONNECT_CONN_ID] if name == "connect" else []
    elif name == "b":
        out = scratch / "diy-parquet"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [PYTHON, str(WORKLOADS / "data_hook.py"), "diy", query, str(BATCH_SIZE), str(out), *on]
    else:
        cmd = spark_submit_cmd(
            WORKLOADS / "data_pyspark_td.py",
            query,
            str(rows // NUM_PROCESSES),
            str(BATCH_SIZE),
        )
    t_fork = time.time()
    sample = run_timed(cmd, env, timeout=3600)
    if name == "b":
        shutil.rmtree(scratch / "diy-parquet", ignore_errors=True)
    result = sample.result
    if sample.rc != 0 or not result:
        log(f"{name} FAILED (rc {sample.rc}):\n{sample.tail}")
        return None
    start = result.get("t_start", t_fork)  # ours: the hook.run call; a: the fork; b: its spark-submit's fork
    ranks = result["ranks"]
    return {
        "to_iterated_s": round(result["t_done"] - start, 3),
        "process_wall_s": sample.wall_s,
        "rows": sum(r["rows"] for r in ranks),
        "ranks": ranks,
        "write_s": round(result["t_written"] - start, 3) if "t_written" in result else None,
        # Over Spark Connect: the task's own process and its Connect driver (the rows pass neither).
        "client_peak_rss_mb": result.get("client_peak_rss_mb"),
        "driver_peak_rss_mb": result.get("driver_peak_rss_mb"),
        "load_before": sample.load_before,
        "load_after": sample.load_after,
    }


def variant_stats(runs: list[dict[str, Any]], arrow_bytes: int) -> dict[str, Any]:
    """Medians over the counted rounds; memory as the worst rank of any round."""
    wall = median([r["to_iterated_s"] for r in runs])
    if wall is None:
        return {"n": 0}
    rows = median([r["rows"] for r in runs])
    rank_gb_s = [
        r_["rows"] * ROW_BYTES / r_["iter_s"] / 1e9 for r in runs for r_ in r["ranks"] if r_["iter_s"]
    ]
    return {
        "n": len(runs),
        "median_s": wall,
        "min_s": min(r["to_iterated_s"] for r in runs),
        "max_s": max(r["to_iterated_s"] for r in runs),
        "rows": rows,
        "rows_per_s": round(rows / wall),
        "mb_per_s": round(arrow_bytes / wall / 1e6, 1),
        "rank_iter_gb_s": median(rank_gb_s),
        "peak_rss_anon_mb": max(r_["peak_rss_anon_mb"] for r in runs for r_ in r["ranks"]),
        "write_median_s": median([r["write_s"] for r in runs if r.get("write_s") is not None]),
        "client_peak_rss_mb": max((r["client_peak_rss_mb"] or 0 for r in runs), default=None) or None,
        "driver_peak_rss_mb": max((r["driver_peak_rss_mb"] or 0 for r in runs), default=None) or None,
    }


def start_netns_cluster(shared: Path, env: dict[str, str]) -> tuple[Any, str]:
    """The two-host netns cluster, and data_hook.py's ``--cluster`` JSON for it; its connection
    (with ``shared-dir``) goes into ``env``."""
    from tests.cluster import start_cluster

    cluster = start_cluster(
        workers=2, cores=1, memory="2g", netns=True, prefix=CLUSTER_PREFIX, subnet=CLUSTER_SUBNET
    )
    driver = f"{CLUSTER_SUBNET}.1"
    conn = {
        "conn_type": "spark",
        "host": f"spark://{cluster.master_host}",
        "port": cluster.master_port,
        "extra": {"shared-dir": str(shared)},
    }
    env[f"AIRFLOW_CONN_{CLUSTER_CONN_ID.upper()}"] = json.dumps(conn)
    spec = {
        "conn_id": CLUSTER_CONN_ID,
        "master": f"spark://{cluster.master_host}:{cluster.master_port}",
        "conf": {
            "spark.driver.host": driver,
            "spark.driver.bindAddress": driver,
            "spark.executor.memory": "1g",
        },
        "env": {"SPARK_LOCAL_IP": driver},
    }
    return cluster, json.dumps(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one counted round")
    parser.add_argument("--gb", type=float, default=2.0, help="data set size as Arrow, GB (default 2)")
    parser.add_argument(
        "--variants",
        help="comma-separated, of: ours,connect,a,b (with --cluster: ours,shuffle,b); default all",
    )
    parser.add_argument("--data-dir", type=Path, help="keep the generated data set here, and reuse it")
    parser.add_argument("--no-save", action="store_true", help="print the section instead of saving it")
    parser.add_argument(
        "--cluster", action="store_true", help="on a two-host netns cluster (module docstring)"
    )
    args = parser.parse_args(argv)
    offered = CLUSTER_VARIANTS if args.cluster else VARIANTS
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else list(offered)
    if unknown := [v for v in chosen if v not in offered]:
        parser.error(f"unknown variant(s) {unknown}; choose among {list(offered)}")
    rounds = 1 if args.quick else args.rounds
    env = bench_env()
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-path-"))
    server = cluster = on = None
    if args.cluster:
        (scratch / "shared").mkdir()
        cluster, on = start_netns_cluster(scratch / "shared", env)
    if "connect" in chosen:
        server = start_connect_server()  # warm across rounds, as a shared Connect server is
        conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": server.port}
        env[f"AIRFLOW_CONN_{CONNECT_CONN_ID.upper()}"] = json.dumps(conn)
    try:
        data_dir = args.data_dir or scratch
        data_dir.mkdir(parents=True, exist_ok=True)
        meta = dataset(data_dir, args.gb, env)
        query = f"SELECT * FROM parquet.`{data_dir / 'parquet'}`"
        samples: dict[str, list[dict[str, Any]]] = {v: [] for v in chosen}
        for round_no in range(rounds + 1):
            for name in chosen:
                run = run_variant(name, query, meta["rows"], scratch, env, on)
                if run is None:
                    continue
                tag = "warm-up" if round_no == 0 else f"round {round_no}/{rounds}"
                worst = max(r["peak_rss_anon_mb"] for r in run["ranks"])
                log(
                    f"{tag} {name}: {run['to_iterated_s']:.1f} s, {run['rows']:,} rows, "
                    f"peak RssAnon {worst:.0f} MB, rank iteration "
                    + ", ".join(f"{r['iter_s']:.2f} s" for r in run["ranks"])
                )
                if round_no:
                    samples[name].append(run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if server is not None:
            server.stop()
        if cluster is not None:
            from tests.cluster import stop_cluster

            stop_cluster(cluster)
    stats = {name: variant_stats(runs, meta["arrow_bytes"]) for name, runs in samples.items()}
    ratios = []
    ours = stats.get("ours", {})
    for name, goal in RATIO_GOALS.items():
        other = stats.get(name, {})
        ratio = round(other["median_s"] / ours["median_s"], 2) if ours.get("n") and other.get("n") else None
        ratios.append(
            {
                "numerator": "ours",
                "denominator": name,
                "ratio": ratio,
                "goal": goal,
                "met": None if ratio is None else ratio >= goal,
            }
        )
    connect = stats.get("connect", {})
    client_rss = (
        max(connect["client_peak_rss_mb"], connect["driver_peak_rss_mb"] or 0) if connect.get("n") else None
    )
    goals = {
        "rank_iter_gb_s": {
            "goal": ITER_GOAL_GB_S,
            "value": ours.get("rank_iter_gb_s"),
            "met": None if not ours.get("n") else ours["rank_iter_gb_s"] >= ITER_GOAL_GB_S,
        },
        "peak_rss_anon_mb": {
            "goal": RSS_GOAL_MB,
            "value": ours.get("peak_rss_anon_mb"),
            "met": None if not ours.get("n") else ours["peak_rss_anon_mb"] <= RSS_GOAL_MB,
        },
        # Over Spark Connect the rows never pass through the Airflow task's process: its memory
        # stays flat, whatever the data's size.
        "connect_client_peak_rss_mb": {
            "goal": CLIENT_RSS_GOAL_MB,
            "value": client_rss,
            "met": None if client_rss is None else client_rss <= CLIENT_RSS_GOAL_MB,
        },
    }
    for name, st in stats.items():
        if st.get("n"):
            log(
                f"{name}: median {st['median_s']} s, {st['rows_per_s']:,} rows/s, {st['mb_per_s']} MB/s, "
                f"rank iteration {st['rank_iter_gb_s']} GB/s, peak RssAnon {st['peak_rss_anon_mb']} MB"
            )
    for r in ratios:
        log(f"throughput ours/{r['denominator']}: {r['ratio']} (goal >= {r['goal']})")
    section = {
        "machine": machine_info(),
        "rounds": rounds,
        "batch_size": BATCH_SIZE,
        "num_processes": NUM_PROCESSES,
        "dataset": meta,
        "variants": {v: offered[v] for v in chosen},
        "stats": stats,
        "ratios": ratios,
        "goals": goals,
        "samples": samples,
    }
    if args.cluster:
        section["cluster"] = True
        section["ratios"] = [r for r in ratios if r["denominator"] == "b"] + [shuffle_ratio(stats)]
        section["goals"] = {k: v for k, v in goals.items() if k != "connect_client_peak_rss_mb"}
    if args.no_save:
        print(json.dumps({k: v for k, v in section.items() if k not in ("machine", "samples")}, indent=2))
        return 0
    update_results("data_path_cluster" if args.cluster else "data_path", section)
    from report import render_docs

    render_docs()
    return 0


def shuffle_ratio(stats: dict[str, Any]) -> dict[str, Any]:
    """On the cluster: ours (through the shared directory) over the shuffle's route."""
    ours, other = stats.get("ours", {}), stats.get("shuffle", {})
    ratio = round(other["median_s"] / ours["median_s"], 2) if ours.get("n") and other.get("n") else None
    return {"numerator": "ours", "denominator": "shuffle", "ratio": ratio, "goal": None, "met": None}


if __name__ == "__main__":
    sys.exit(main())
