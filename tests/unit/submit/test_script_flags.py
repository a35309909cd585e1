"""A script's ``kwargs`` as its command-line flags, and the ones refused (at parse time, with the
operator, for literal values)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.submit.script_flags import script_flags


def test_values_become_flags_in_order_and_false_or_none_are_left_out() -> None:
    flags = script_flags(
        {"epochs": 3, "lr": 0.1, "amp": True, "resume": False, "tag": None, "out": Path("/m"), "name": "a b"}
    )
    assert flags == ["--epochs", "3", "--lr", "0.1", "--amp", "--out", "/m", "--name", "a b"]
    assert script_flags(None) == script_flags({}) == []


def test_argparse_reads_back_what_was_meant() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--shift", type=float)
    parser.add_argument("--mode")
    kwargs = {"epochs": 3, "batch-size": 32, "amp": True, "shift": -0.5, "mode": "--fast"}
    parsed = parser.parse_args(script_flags(kwargs))
    # A value that starts with "-" travels as --key=value, so it is never read as the next option.
    assert vars(parsed) == {"epochs": 3, "batch_size": 32, "amp": True, "shift": -0.5, "mode": "--fast"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": [64, 32]}, r"kwargs 'layers' is a list.*nargs='\+'.*action='append'.*args=\['--layers'"),
        ({"opt": {"lr": 1}}, r"kwargs 'opt' is a dict.*JSON string"),
        ({"--epochs": 3}, r"kwargs key '--epochs' cannot be a command-line flag.*without the dashes"),
        ({"two words": 1}, r"kwargs key 'two words' cannot be a command-line flag"),
        ({"": 1}, r"kwargs key '' cannot be"),
        ({"lr": float("nan")}, r"kwargs 'lr'=nan is not a finite number"),
    ],
)
def test_ambiguous_kwargs_are_refused_naming_the_key(kwargs, match) -> None:
    with pytest.raises(InvalidTrainingConfig, match=match):
        script_flags(kwargs)


def test_the_operator_refuses_them_when_the_dag_is_parsed(tmp_path: Path) -> None:
    script = str(tmp_path / "train.py")
    with pytest.raises(InvalidTrainingConfig, match=r"kwargs 'layers' is a list"):
        TorchDistributorOperator(task_id="t", train_object=script, kwargs={"layers": [1, 2]})
    # Templates and upstream values are checked once rendered; plain flags pass.
    op = TorchDistributorOperator(
        task_id="t2", train_object=script, kwargs={"epochs": 3, "data": "{{ params.data }}"}
    )
    assert op.train_kwargs == {"epochs": 3, "data": "{{ params.data }}"}
    # A callable's kwargs are its keyword arguments: any value.
    TorchDistributorOperator(task_id="t3", train_object=print, kwargs={"layers": [1, 2], "opt": {"a": 1}})
