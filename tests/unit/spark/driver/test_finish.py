"""The driver's end of a run: the outcome written and said once (before its SparkContext stops)."""

from __future__ import annotations

from airflow_provider_torchdist.spark.driver.finish import finish, finished_code
from airflow_provider_torchdist.spark.wire.outcome import Outcome


def test_an_outcome_is_written_and_said_once_and_its_code_kept(tmp_path, capsys) -> None:
    assert finished_code(tmp_path) is None
    assert finish(Outcome(ok=True), tmp_path) == 0
    # Spark failing to stop afterwards does not change what the owner may have concluded already.
    assert finish(Outcome(ok=False, error="RuntimeError: stopping Spark failed"), tmp_path) == 0
    assert finished_code(tmp_path) == 0
    assert Outcome.read(tmp_path).ok
    assert capsys.readouterr().out.count("[torchdist] training finished on all ranks") == 1
