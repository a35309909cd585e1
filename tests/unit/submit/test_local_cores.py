"""More ranks on this machine than its cores: one warning, when the task starts, saying what to do.

The parse-time half (literal ``local_mode=True``) is in ``tests/unit/operators/test_parse_time_mistakes.py``.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from airflow_provider_torchdist.submit import local_cores
from airflow_provider_torchdist.submit.checks import build_spec
from airflow_provider_torchdist.submit.connection import SparkTarget, embedded_target
from airflow_provider_torchdist.submit.prepare import check_and_stage

CORES = local_cores.usable_cores()
LOG = logging.getLogger("test_local_cores")


def _train() -> int:
    return 0


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_cores, "_given", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "-core machine" in r.getMessage()
    ]


@pytest.mark.parametrize(
    "local_mode, why",
    [
        (True, "local_mode=True runs every rank on this Airflow worker (the Spark driver)"),
        (False, f"the Spark master local[{CORES + 1}] runs every rank on this Airflow worker"),
    ],
)
def test_the_task_start_warns_once_when_local_ranks_outnumber_the_cores(
    local_mode: bool, why: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook's own preparation (checks, then staging), on the embedded master, twice: one warning."""
    spec = build_spec(num_processes=CORES + 1, local_mode=local_mode, staging_dir=str(tmp_path))
    target = embedded_target(spec)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            staged, _, _ = check_and_stage(spec, target, LOG, _train, [], {})
            shutil.rmtree(staged.dir)
    assert _warnings(caplog) == [
        f"num_processes={CORES + 1} on a {CORES}-core machine: {why}, so the {CORES + 1} ranks will time-share "
        f"{CORES} cores, each step slower than with one core per rank. Use num_processes<={CORES} here, or "
        "train on a cluster (a Spark connection, local_mode=False)."
    ]


def test_ranks_that_fit_or_run_on_a_cluster_are_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    cluster = SparkTarget(master="spark://10.0.0.1:7077", connection={})
    with caplog.at_level(logging.WARNING):
        local_cores.warn_at_run(build_spec(num_processes=CORES, local_mode=True), cluster, LOG)
        local_cores.warn_at_run(build_spec(num_processes=CORES + 1), cluster, LOG)
        fits = build_spec(num_processes=CORES)
        local_cores.warn_at_run(fits, embedded_target(fits), LOG)
    assert _warnings(caplog) == []


def test_an_elastic_run_counts_its_most_ranks(caplog: pytest.LogCaptureFixture) -> None:
    spec = build_spec(num_processes=f"1:{CORES + 2}")
    with caplog.at_level(logging.WARNING):
        local_cores.warn_at_run(spec, embedded_target(spec), LOG)
    assert [f"num_processes={CORES + 2} on a {CORES}-core machine" in w for w in _warnings(caplog)] == [True]
