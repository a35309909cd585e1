"""The chaos soak, full form: N runs of a small checkpointing training, each hit by one fault.

Usage: ``python bench/chaos.py [--runs 40] [--seed 27]`` (root: it makes network namespaces and
mounts the staging disk)

It starts what the soak needs, once: a netns Spark cluster (master and 2 one-core Workers, each
Worker a host of its own), PostgreSQL and an Airflow deployment on it
(``scripts/airflow-standalone``) serving ``tests/integration/dags/chaos_dags.py``, and a 64 MB
tmpfs as the runs' staging disk. Each run gets one fault, in turn through every kind (SIGKILL of
a rank, an agent, an executor JVM, a Worker, the supervisor, the task process, the triggerer; the
Worker's link down for 5 to 20 s; the staging disk full for 8 s; a rank SIGSTOPped, so that the
run is found hung), at a random moment of its
training, and is checked for the four invariants of ``tests/integration/chaos.py``. The table
goes to ``latest.json`` (section ``chaos``) and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import REPO, log, machine_info, update_results

sys.path.insert(0, str(REPO))

from tests.cluster import leftover_network, start_cluster, stop_cluster  # noqa: E402
from tests.integration.chaos import FAULTS, Bed, add_connection, one_run, table  # noqa: E402
from tests.integration.deployment import dag_folder, running_deployment  # noqa: E402
from tests.integration.postgres import start_postgres, stop_postgres  # noqa: E402
from tests.integration.run_processes import OWN_DIRECTORIES, mark_this_worker  # noqa: E402

PREFIX = "tdcb"
SUBNET = "10.231.96"
CONN_ID = "torchdist_chaos"


@contextlib.contextmanager
def staging_disk(path: Path, size: str = "64m") -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def soak_bed(work: Path) -> Iterator[Bed]:
    """The cluster, PostgreSQL, the deployment and the staging disk; all stopped at the end."""
    mark_this_worker()  # what the process scans keep to (tests/integration/run_processes.py)
    with staging_disk(work / "staging") as disk:
        os.environ["TORCHDIST_CHAOS_STAGING"] = str(disk)  # the deployment's DAG parser reads it
        # The runs stage there, not under the deployment's home: their supervisors (retitled, with no
        # readable environment) are known as this soak's by that directory in their command line.
        OWN_DIRECTORIES.append(str(disk))
        cluster = start_cluster(workers=2, cores=1, memory="1g", netns=True, prefix=PREFIX, subnet=SUBNET)
        postgres = start_postgres()
        try:
            home, dags = work / "airflow", dag_folder(work / "dags")
            home.mkdir()
            settings = {
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres.url("postgresql+psycopg2"),
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            }
            with running_deployment(home, dags, settings) as deployment:
                add_connection(deployment, CONN_ID, cluster)
                deployment.wait_parsed("chaos_durable")
                deployment.wait_parsed("chaos_deferrable")
                deployment.wait_parsed("chaos_hang_watch")
                yield Bed(deployment, cluster, CONN_ID, work / "runs", disk)
        finally:
            stop_postgres(postgres)
            stop_cluster(cluster)
            assert not leftover_network(PREFIX)


def _record(args: argparse.Namespace, results: list, started: float, done: bool) -> None:
    """The section so far, after every run: a soak cut short still leaves what it saw."""
    update_results(
        "chaos",
        {
            "machine": machine_info(),
            "runs": len(results),
            "planned": args.runs,
            "complete": done,
            "seed": args.seed,
            "minutes": round((time.monotonic() - started) / 60, 1),
            "table": table(results),
            "results": [vars(r) for r in results],
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=27)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchdist-chaos-") as tmp, soak_bed(Path(tmp)) as bed:
        for index in range(args.runs):
            fault = FAULTS[index % len(FAULTS)]
            result = one_run(bed, index, fault, rng)
            results.append(result)
            log(
                f"run {index + 1}/{args.runs} {fault}: {result.state} after {result.tries} tr(y/ies), {result.held}"
            )
            if result.detail:
                log(f"  {result.detail}")
            _record(args, results, started, done=index + 1 == args.runs)
    print(table(results))
    from report import render_docs

    render_docs()
    broken = [r for r in results if not all(r.held.values())]
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
