"""Input checks shared by the operator and the hook."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.submit.validation import (
    check_args,
    check_bool,
    check_int,
    check_topology,
    check_train_object,
    check_world_size,
    is_template,
    world_size_bounds,
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


# -- elastic ranges: num_processes="MIN:MAX" ------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [("2:4", "2:4"), (" 2 : 4 ", "2:4"), ("4:4", "4:4"), ("1:8", "1:8"), (4, 4), ("4", 4), (" 3 ", 3)],
)
def test_world_size_is_an_integer_or_a_normalized_range(value, expected):
    result = check_world_size(value)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("value", ["2:", ":4", "a:b", "1:2:3", "-1:2", "2.0:4", "\uff12:4", "2 4:6"])
def test_a_malformed_range_is_refused_with_examples(value):
    with pytest.raises(
        InvalidTrainingConfig,
        match=r'num_processes must be an integer >= 1 or an elastic range "MIN:MAX".*"2:4"',
    ):
        check_world_size(value)


@pytest.mark.parametrize("value", ["", "abc", 0, True, 2.5])
def test_what_is_no_range_is_checked_as_an_integer_as_before(value):
    with pytest.raises(InvalidTrainingConfig, match=r"^num_processes must be an integer >= 1, got"):
        check_world_size(value)


def test_a_range_below_one_or_upside_down_is_refused_with_the_fix():
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes='0:2': MIN must be at least 1.*\"1:2\""):
        check_world_size("0:2")
    with pytest.raises(
        InvalidTrainingConfig, match=r"num_processes='4:2': MIN=4 is more than MAX=2.*\"2:4\""
    ):
        check_world_size("4:2")


def test_world_size_bounds():
    assert world_size_bounds("2:4") == (2, 4) and world_size_bounds(3) == (3, 3)


def test_topology_takes_a_range_in_whole_nodes():
    assert check_topology(" 2 : 4 ", "2", "false") == ("2:4", 2, False)
    assert check_topology("4:4", 2, False) == ("4:4", 2, False)  # still elastic: survives no loss, rejoins


@pytest.mark.parametrize(
    "value, nproc, named, fix",
    [
        ("2:3", 2, r"MAX=3 is not a multiple", '"2:4"'),
        ("3:8", 4, r"MIN=3 is not a multiple", '"4:8"'),
        ("1:3", 2, r"MIN=1 and MAX=3 are not multiples", '"2:4"'),
        ("3:3", 2, r"MIN=3 and MAX=3 are not multiples", '"4:4"'),
    ],
)
def test_range_bounds_must_be_whole_nodes_naming_the_bound(value, nproc, named, fix):
    with pytest.raises(
        InvalidTrainingConfig, match=rf"num_processes='{value}': {named} of nproc_per_node={nproc}"
    ) as e:
        check_topology(value, nproc, False)
    assert f"num_processes={fix}" in str(e.value)  # a concrete suggestion that passes
    check_topology(fix.strip('"'), nproc, False)


def test_a_range_is_refused_in_local_mode_saying_why():
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"num_processes='2:4' is an elastic range, but local_mode=True runs every rank on the Spark "
        r"driver.*no node to lose or add.*local_mode=False.*such as 4",
    ):
        check_topology("2:4", 1, True)


def test_a_range_over_the_cap_is_refused_naming_max():
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes MAX=100001 is more than 100000"):
        check_topology("2:100001", 1, False)
    assert check_topology("2:100000", 1, False) == ("2:100000", 1, False)
