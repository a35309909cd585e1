"""Input checks shared by the operator and the hook."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.validation import (
    check_args,
    check_bool,
    check_int,
    check_topology,
    check_train_object,
    is_template,
)


@pytest.mark.parametrize("value", [0, -1, 1.5, "abc", True, False, None, "1.5", "-1", "", [2]])
def test_num_processes_refused_naming_the_field(value):
    with pytest.raises(InvalidTrainingConfig, match=r"^num_processes must be an integer >= 1"):
        check_int(value, "num_processes")


@pytest.mark.parametrize("value, expected", [("2", 2), (" 3 ", 3), (4, 4), ("1", 1)])
def test_integer_strings_become_integers(value, expected):
    result = check_int(value, "num_processes")
    assert result == expected and type(result) is int


def test_minimum_zero_allows_zero():
    assert check_int("0", "max_restarts", minimum=0) == 0
    with pytest.raises(InvalidTrainingConfig, match="max_restarts must be an integer >= 0, got -1"):
        check_int(-1, "max_restarts", minimum=0)


@pytest.mark.parametrize(
    "value, expected", [(True, True), (False, False), ("True", True), (" false ", False)]
)
def test_bools(value, expected):
    assert check_bool(value, "local_mode") is expected


@pytest.mark.parametrize("value", [1, 0, "yes", None, "1"])
def test_non_bools_refused(value):
    with pytest.raises(InvalidTrainingConfig, match="local_mode must be True or False"):
        check_bool(value, "local_mode")


def test_topology_not_divisible_refused_in_distributed_mode():
    with pytest.raises(
        InvalidTrainingConfig, match=r"num_processes=5 is not divisible by nproc_per_node=2"
    ) as e:
        check_topology(5, 2, False)
    assert "num_processes=4" in str(e.value)  # a concrete suggestion


def test_topology_suggestion_is_valid_when_total_is_below_nproc():
    with pytest.raises(InvalidTrainingConfig, match=r"Use e\.g\. num_processes=4\.") as e:
        check_topology(3, 4, False)
    assert "num_processes=0" not in str(e.value)


def test_topology_not_divisible_is_fine_in_local_mode():
    assert check_topology(5, 2, True) == (5, 2, True)


def test_topology_coerces_rendered_strings():
    assert check_topology("4", "2", "false") == (4, 2, False)


def test_topology_names_the_bad_field():
    with pytest.raises(InvalidTrainingConfig, match="nproc_per_node"):
        check_topology(4, 0, False)
    with pytest.raises(InvalidTrainingConfig, match="local_mode"):
        check_topology(4, 1, "maybe")


@pytest.mark.parametrize("value", [42, None, "", "   ", 1.0, ["train.py"]])
def test_train_object_refused(value):
    with pytest.raises(InvalidTrainingConfig, match="train_object must be a callable or the path"):
        check_train_object(value)


def test_train_object_accepted():
    assert check_train_object(print) is print
    assert check_train_object("/x/train.py") == "/x/train.py"
    assert check_train_object(Path("/x/train.py")) == "/x/train.py"


def test_args_and_kwargs():
    assert check_args(None, "args", list) == []
    assert check_args((1, 2), "args", list) == [1, 2]
    assert check_args(None, "kwargs", dict) == {}
    assert check_args({"a": 1}, "kwargs", dict) == {"a": 1}
    with pytest.raises(InvalidTrainingConfig, match="args must be a list, got str"):
        check_args("abc", "args", list)
    with pytest.raises(InvalidTrainingConfig, match="kwargs must be a dict, got list"):
        check_args([1], "kwargs", dict)
    with pytest.raises(InvalidTrainingConfig, match="kwargs keys must be strings"):
        check_args({1: 2}, "kwargs", dict)


def test_is_template():
    assert is_template("{{ params.n }}")
    assert not is_template("2")
    assert not is_template(2)
