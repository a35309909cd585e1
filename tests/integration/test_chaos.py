"""The chaos soak's short form (``bench/chaos.py`` is the full one; see tests/integration/chaos.py):
one run of each fault, through the shared deployment, on a netns cluster of this module's own. Every
run must hold every invariant; the table is printed.

Two faults are the full form's only: the full staging disk needs the soak's own disk, and the
frozen rank (a SIGSTOP found by the hang watch, 30 s of ``hang_timeout`` and a retry: 90 s) is
what ``test_hangs.py`` already proves on a run of its own."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import ClusterInfo, leftover_network, start_cluster, stop_cluster
from tests.integration.chaos import FAULTS, Bed, add_connection, one_run, table
from tests.integration.deployment import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_supervisor_left")]

PREFIX = "tdch"
SUBNET = "10.231.95"
CONN_ID = "torchdist_chaos"
FULL_FORM_ONLY = ("disk", "frozen")


@pytest.fixture(scope="module")
def chaos_cluster() -> Iterator[ClusterInfo]:
    if os.geteuid() != 0:
        pytest.fail("the chaos soak needs root to create network namespaces (CI runs as root)")
    info = start_cluster(workers=2, cores=1, memory="1g", netns=True, prefix=PREFIX, subnet=SUBNET)
    try:
        yield info
    finally:
        stop_cluster(info)
    assert not leftover_network(PREFIX)


# Nine faulted runs, one after another: about 8 min on a quiet 2-core machine (the 900 s default is for one run).
@pytest.mark.timeout(1800)
def test_one_run_of_each_fault_holds_every_invariant(
    deployment: Deployment, chaos_cluster: ClusterInfo, tmp_path: Path
) -> None:
    add_connection(deployment, CONN_ID, chaos_cluster)
    deployment.wait_parsed("chaos_durable")
    deployment.wait_parsed("chaos_deferrable")
    bed = Bed(deployment, chaos_cluster, CONN_ID, tmp_path)
    rng = random.Random(int(os.environ.get("TORCHDIST_CHAOS_SEED", "27")))
    results = [
        one_run(bed, i, fault, rng) for i, fault in enumerate(f for f in FAULTS if f not in FULL_FORM_ONLY)
    ]
    broken = [r for r in results if not all(r.held.values())]
    assert not broken, f"{table(results)}\n\n{broken}"
