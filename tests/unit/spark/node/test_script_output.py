"""``set_output()``: a script's rank 0 hands on the last value it set; other ranks' calls do
nothing; a callable must return its value instead. The script runs for real (``runpy``, as a rank
runs it), through :func:`~airflow_provider_torchdist.spark.node.rank.call_work`."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchdist import set_output
from airflow_provider_torchdist.spark.node import rank, script_output
from airflow_provider_torchdist.spark.wire.jobspec import PAYLOAD_FILE, JobSpec

SCRIPT = """
import sys
from airflow_provider_torchdist import set_output

set_output({"first": True})
set_output({"model_path": "/models/m.pt", "args": sys.argv[1:]})  # the last value is kept
if "--exit" in sys.argv:
    sys.exit(0)  # a script's normal end, as its last line would be
"""


def _spec(kind: str, entry: str, *script_args: str) -> JobSpec:
    return JobSpec(
        kind=kind, entry=entry, script_args=list(script_args), num_processes=2, run_id="r", token="t"
    )


@pytest.mark.parametrize("args", [["--epochs", "3"], ["--exit"]])
def test_rank_zero_hands_on_the_last_value_it_set(tmp_path: Path, monkeypatch, args) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("RANK", "0")
    assert rank.call_work(_spec("script", "train.py", *args), str(script)) is None
    assert script_output.taken() == {"model_path": "/models/m.pt", "args": args}
    assert script_output.taken() is None  # taken once


def test_another_ranks_call_does_nothing(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("RANK", "1")
    rank.call_work(_spec("script", "train.py"), str(script))
    assert script_output.taken() is None


def test_a_script_that_sets_nothing_hands_on_none(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    monkeypatch.setenv("RANK", "0")
    script_output.begin("script")
    set_output("stale")  # from an earlier run in this process: begin() forgets it
    rank.call_work(_spec("script", "train.py"), str(script))
    assert script_output.taken() is None


def test_a_failing_exit_code_still_fails(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exited:
        rank.call_work(_spec("script", "train.py"), str(script))
    assert exited.value.code == 3


def test_a_callable_is_told_to_return_its_value(tmp_path: Path, monkeypatch) -> None:
    import cloudpickle

    def train() -> None:
        set_output(1)

    payload = tmp_path / PAYLOAD_FILE
    payload.write_bytes(cloudpickle.dumps({"fn": train, "args": [], "kwargs": {}}))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=r"set_output\(\) is for training scripts.*Return the value"):
        rank.call_work(_spec("callable", PAYLOAD_FILE), str(payload))
    script_output.begin("script")  # leave this process as a script's rank


def test_outside_a_run_it_keeps_the_value_and_does_nothing_else(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    script_output.begin("script")
    set_output([1, 2])
    assert script_output.taken() == [1, 2]
