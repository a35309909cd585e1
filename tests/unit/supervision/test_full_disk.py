"""A full staging disk (the chaos soak's fault): every part says so and none of them hangs.

Found by ``bench/chaos.py``: the supervisor's log line after spark-submit raised ENOSPC in its run
thread, which died, and the run was never concluded (the DAG run waited until its timeout)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from airflow_provider_torchdist.spark import app
from airflow_provider_torchdist.spark.wire.outcome import Outcome
from airflow_provider_torchdist.supervision import config
from airflow_provider_torchdist.supervision.submission import run_verdict


def _full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_the_supervisors_log_line_is_lost_on_a_full_disk_but_the_supervisor_goes_on(monkeypatch):
    monkeypatch.setattr("builtins.print", _full)
    config.log("spark-submit ended")  # no exception


def test_anything_unforeseen_in_the_run_thread_still_concludes_the_run():
    from airflow_provider_torchdist.supervision.run_supervisor import RunSupervisor

    finished: list[tuple[str, dict]] = []
    supervisor = RunSupervisor.__new__(RunSupervisor)
    supervisor._submit_and_conclude = lambda: _full()  # type: ignore[method-assign]
    supervisor._finish = lambda state, **details: finished.append((state, details))  # type: ignore[method-assign]
    thread = threading.Thread(target=supervisor._run)
    thread.start()
    thread.join(5)
    assert finished and finished[0][0] == "failed"
    assert "supervisor failed while it ran the run" in finished[0][1]["error"]
    assert "No space left on device" in finished[0][1]["error"]


def test_a_driver_that_cannot_write_its_outcome_says_so_and_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Outcome, "write", _full)
    assert app.finish(Outcome(ok=True), tmp_path) == 1
    assert f"the run's outcome could not be written to {tmp_path}: [Errno 28] No space left on device" in (
        capsys.readouterr().out
    )


def test_the_verdict_names_the_staging_disk_when_the_outcome_was_cut_short(tmp_path: Path):
    (tmp_path / "outcome.tmp").write_text("")
    state, details = run_verdict(tmp_path, None, RuntimeError("spark-submit exited 1"))
    assert state == "failed"
    assert (
        f"could not write its outcome into the staging directory {tmp_path} (is its disk full?)"
        in details["error"]
    )
    os.remove(tmp_path / "outcome.tmp")
    assert "before the training driver reported an outcome" in run_verdict(tmp_path, None, None)[1]["error"]


def test_rank_zeros_value_that_cannot_be_written_is_not_called_unpicklable(tmp_path, monkeypatch):
    from airflow_provider_torchdist.spark.node import rank_output

    monkeypatch.setattr(rank_output.os, "fdopen", _full)
    with pytest.raises(
        OSError, match=r"rank 0's return value could not be written to .*No space left on device"
    ):
        rank_output.send_output(None, {"total": 1.0}, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the half-written file is gone
