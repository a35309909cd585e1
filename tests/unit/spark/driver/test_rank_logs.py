"""``log_ranks``: which ranks' lines reach the task log, where the others go, and what always shows."""

from __future__ import annotations

import stat

import pytest

from airflow_provider_torchdist import TorchDistributorOperator
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.driver.rank_logs import (
    RANKS_LOG,
    TAIL_LINES,
    RankLogFilter,
    rank_filter,
)
from airflow_provider_torchdist.submit.checks import build_spec


@pytest.mark.parametrize(
    "value, shown",
    [("all", "all"), (None, "all"), ("0,3", [0, 3]), (" 3 , 0 ", [0, 3]), ([1, 1, 0], [0, 1]), ([], [])],
)
def test_log_ranks_takes_all_a_list_or_a_comma_string(value, shown) -> None:
    assert build_spec(log_ranks=value, num_processes=4).log_ranks == shown


@pytest.mark.parametrize("value", ["0;3", "0 3", "", "some", [True], [-1], [0.0], "٣", {"0": 1}])
def test_bad_log_ranks_fail_when_the_dag_is_parsed(value) -> None:
    with pytest.raises(InvalidTrainingConfig, match='log_ranks must be "all", a list of global ranks'):
        TorchDistributorOperator(task_id="t", train_object=print, log_ranks=value, num_processes=4)


def test_log_ranks_beyond_the_world_fail_when_the_dag_is_parsed() -> None:
    with pytest.raises(
        InvalidTrainingConfig, match=r"log_ranks names rank\(s\) \[4\], but the run has ranks 0..3"
    ):
        TorchDistributorOperator(task_id="t", train_object=print, log_ranks=[0, 4], num_processes=4)


def test_an_elastic_runs_log_ranks_may_name_any_rank_below_max() -> None:
    assert build_spec(log_ranks=[0, 3], num_processes="2:4").log_ranks == [0, 3]
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"log_ranks names rank\(s\) \[4\], but the run has ranks 0..3 \(num_processes='2:4'\)",
    ):
        TorchDistributorOperator(task_id="t", train_object=print, log_ranks="0,4", num_processes="2:4")


def test_filtered_lines_go_to_a_private_file_and_a_failing_ranks_tail_shows_once(tmp_path) -> None:
    assert rank_filter("all", tmp_path) is None
    f = rank_filter([0], tmp_path)
    assert f is not None and f.shows(0) and not f.shows(1)
    for i in range(TAIL_LINES + 5):
        assert f.hold(1, f"[rank 1 @ h] line {i}")
    assert "only rank(s) 0 shown" in f.announcement() and str(tmp_path / RANKS_LOG) in f.announcement()
    tail = f.failed(1)
    assert tail == [f"[rank 1 @ h] line {i}" for i in range(5, TAIL_LINES + 5)]
    assert f.failed(1) == [] and f.shows(1)  # once; from now on its lines (its traceback) show
    f.close()
    log = tmp_path / RANKS_LOG
    assert log.read_text().splitlines() == [f"[rank 1 @ h] line {i}" for i in range(TAIL_LINES + 5)]
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert RankLogFilter([], tmp_path).announcement().startswith("log_ranks: only rank(s) none shown")
