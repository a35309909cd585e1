"""Mistakes seen when Airflow parses the DAG file: real DAG files through Airflow's own DagBag.

An unknown argument is named with the closest known one (and blamed on ``spark_submit_kwargs``
only when that was passed); a script's ``args`` that no command line can carry are refused; more
local ranks than the machine's cores give one DAG warning.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:  # Airflow before 3.1 (the lowest-versions run)
    from airflow.models.dagbag import DagBag

from airflow_provider_torchdist import TorchDistributorHook, TorchDistributorOperator
from airflow_provider_torchdist.errors import InvalidTrainingConfig, UnknownArgument
from airflow_provider_torchdist.submit import local_cores

HEADER = """\
import pendulum
from airflow.sdk import dag
from airflow_provider_torchdist import TorchDistributorOperator


def train(lr=0.1):
    return lr


@dag(schedule=None, start_date=pendulum.datetime(2024, 1, 1))
def mistakes():
"""


def _parse(tmp_path: Path, body: str) -> DagBag:
    """Airflow's DagBag over a dags folder holding one DAG file whose tasks are ``body``."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "mistakes.py").write_text(
        HEADER + textwrap.indent(textwrap.dedent(body), "    ") + "\n\nmistakes()\n"
    )
    return DagBag(str(dags))


def _import_error(bag: DagBag) -> str:
    [error] = bag.import_errors.values()
    return error.strip().splitlines()[-1]  # the exception's own line, after the traceback


@pytest.mark.parametrize(
    "body, expected",
    [
        pytest.param(
            'TorchDistributorOperator(task_id="t", train_object=train, num_process=2)',
            "UnknownArgument: TorchDistributorOperator (task_id 't') got an unknown argument: "
            "num_process (did you mean num_processes?)",
            id="setting",
        ),
        pytest.param(
            'TorchDistributorOperator(task_id="t", train_object=train, retires=2)',
            "got an unknown argument: retires (did you mean retries?)",
            id="base-operator-argument",
        ),
        pytest.param(
            'TorchDistributorOperator.partial(task_id="t", train_object=train, local_mod=True).expand('
            'kwargs=[{"lr": 0.1}, {"lr": 0.2}])',
            "got an unknown argument: local_mod (did you mean local_mode?)",
            id="mapped",
        ),
        pytest.param(
            'TorchDistributorOperator(task_id="t", train_object=train, spark_submit_kwargs={"driver_memroy": "1g"})',
            "spark_submit_kwargs (SparkSubmitHook's arguments) got an unknown argument: driver_memroy "
            "(did you mean driver_memory?)",
            id="spark_submit_kwargs",
        ),
    ],
)
def test_a_typo_fails_the_dag_import_naming_the_closest_argument(
    tmp_path: Path, body: str, expected: str
) -> None:
    bag = _parse(tmp_path, body)
    assert bag.dag_ids == []
    error = _import_error(bag)
    assert expected in error
    if "spark_submit_kwargs=" not in body:
        assert "spark_submit_kwargs" not in error  # never blamed on what the user did not pass


def test_the_hook_names_a_typo_as_its_own_argument() -> None:
    with pytest.raises(
        UnknownArgument, match=r"TorchDistributorHook got an unknown argument: num_process \(did"
    ) as e:
        TorchDistributorHook(num_process=2)
    assert "spark_submit_kwargs" not in str(e.value)
    assert isinstance(e.value, TypeError)  # as Python's own "unexpected keyword argument" is


@pytest.mark.parametrize(
    "args, what",
    [
        ([{"lr": 0.1}], "args[0] is a dict"),
        (["--lr", None], "args[1] is None"),
        ([["a", "b"]], "args[0] is a list"),
    ],
)
def test_script_args_that_no_command_line_carries_are_refused_at_parse(args: list, what: str) -> None:
    with pytest.raises(
        InvalidTrainingConfig, match=rf"{re.escape(what)} \(.*\), but a script's args are its command-line"
    ):
        TorchDistributorOperator(task_id="t", train_object="/dags/train.py", args=args)


def test_script_args_of_strings_numbers_paths_and_templates_are_taken() -> None:
    op = TorchDistributorOperator(
        task_id="t", train_object="/dags/train.py", args=["--lr", 0.1, 3, Path("/data"), "{{ params.x }}"]
    )
    assert op.train_args[1] == 0.1
    # A callable takes any value.
    TorchDistributorOperator(task_id="c", train_object=lambda cfg: cfg, args=[{"lr": 0.1}, None])


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has given no cores warning yet (they are given once per process)."""
    monkeypatch.setattr(local_cores, "_given", set())


@pytest.mark.usefixtures("fresh_warnings")
def test_more_local_ranks_than_cores_is_one_dag_warning_saying_what_to_do(tmp_path: Path) -> None:
    cores = local_cores.usable_cores()
    bag = _parse(
        tmp_path,
        f"""\
        TorchDistributorOperator(task_id="a", train_object=train, num_processes={cores + 1}, local_mode=True)
        TorchDistributorOperator(task_id="b", train_object=train, num_processes={cores + 1}, local_mode=True)
        TorchDistributorOperator(task_id="fits", train_object=train, num_processes={cores}, local_mode=True)
        """,
    )
    assert bag.import_errors == {}
    [warnings] = bag.captured_warnings.values()
    assert len(warnings) == 1, warnings  # once, though two tasks ask for it
    [warning] = warnings
    assert f"mistakes.py:{HEADER.count(chr(10)) + 1}: " in warning  # the DAG file's line of the first task
    assert f"num_processes={cores + 1} on a {cores}-core machine" in warning
    assert f"Use num_processes<={cores} here, or train on a cluster" in warning


@pytest.mark.usefixtures("fresh_warnings")
def test_a_templated_or_distributed_run_is_not_warned_at_parse(tmp_path: Path) -> None:
    cores = local_cores.usable_cores()
    bag = _parse(
        tmp_path,
        f"""\
        TorchDistributorOperator(task_id="a", train_object=train, num_processes="{{{{ params.n }}}}", local_mode=True)
        TorchDistributorOperator(task_id="b", train_object=train, num_processes={cores + 1})
        """,
    )
    assert bag.import_errors == {} and bag.captured_warnings == {}
