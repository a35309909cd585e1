"""A function from a DAG file keeps its file name through the payload: a rank's traceback names
the DAG file and line, not ``File "<dynamic-code>"``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from airflow_provider_torchdist.submit.payload import pickle_payload

DAG_SOURCE = textwrap.dedent(
    """\
    import math


    def helper(x):
        return math.sqrt(x) / 0  # line 5


    def train(x):
        return helper(x) + 1  # line 9
    """
)

#: What a rank does with the payload (``rank.py``: load it, call it); prints the traceback.
RANK = textwrap.dedent(
    """\
    import sys, traceback, cloudpickle
    with open(sys.argv[1], "rb") as f:
        payload = cloudpickle.load(f)
    try:
        payload["fn"](*payload["args"], **payload["kwargs"])
    except ZeroDivisionError:
        traceback.print_exc(file=sys.stdout)
    """
)


@pytest.fixture
def dag_module(tmp_path: Path):
    """A module loaded from a DAG file as Airflow's DagBag loads one: an unimportable name, in
    ``sys.modules`` while the file is parsed."""
    path = tmp_path / "dags" / "my_dag.py"
    path.parent.mkdir()
    path.write_text(DAG_SOURCE)
    name = "unusual_prefix_0123_my_dag"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_a_ranks_traceback_names_the_dag_file_and_line(dag_module, tmp_path: Path) -> None:
    dag_file = dag_module.__file__
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle_payload(dag_module.train, [4.0], {}))
    Path(dag_file).unlink()  # as on an executor: the file is not there, only the code travelled

    rank = subprocess.run(
        [sys.executable, "-c", RANK, str(payload)], capture_output=True, text=True, timeout=60, check=True
    )

    assert f'File "{dag_file}", line 9, in train' in rank.stdout, rank.stdout
    assert f'File "{dag_file}", line 5, in helper' in rank.stdout, rank.stdout
    assert "<dynamic-code>" not in rank.stdout
