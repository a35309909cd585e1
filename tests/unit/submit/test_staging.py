"""Staging: pickling by value, naming what cannot be pickled, the private staging directory, the zip."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import zipfile
from pathlib import Path

import cloudpickle
import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig, PayloadNotPicklable
from airflow_provider_torchdist.spark.wire.jobspec import PAYLOAD_FILE, SPEC_FILE, JobSpec
from airflow_provider_torchdist.submit.staging import (
    DRIVER_SCRIPT,
    PACKAGE_DIR,
    SPARK_ZIP,
    modules_to_pickle_by_value,
    pickle_payload,
    stage_run,
)

DAG_MODULE_NAME = "unusual_prefix_abc_dagfile"

DAG_SOURCE = textwrap.dedent(
    """
    SCALE = 3

    def helper(x):
        return x * SCALE

    def train(x, *, offset=0):
        return helper(x) + offset
    """
)

# Loads a payload and calls it, in a fresh interpreter that knows nothing of the DAG folder.
LOAD_AND_CALL = (
    "import sys, cloudpickle\n"
    "p = cloudpickle.load(open(sys.argv[1], 'rb'))\n"
    "print(p['fn'](*p['args'], **p['kwargs']))\n"
)

_GLOBAL_LOCK = threading.Lock()


def _train(x, y=0):
    return x * 10 + y


def _uses_global_lock():
    with _GLOBAL_LOCK:
        return 1


def _closure_over_lock():
    lock = threading.Lock()

    def train_with_lock():
        with lock:
            return 1

    return train_with_lock


@pytest.fixture
def dag_module(tmp_path):
    """A module imported the way Airflow imports a DAG file: from outside sys.path, under an odd name."""
    folder = tmp_path / "dags"
    folder.mkdir()
    path = folder / "my_dag.py"
    path.write_text(DAG_SOURCE)
    spec = importlib.util.spec_from_file_location(DAG_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[DAG_MODULE_NAME] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(DAG_MODULE_NAME, None)


def _load_in_fresh_python(payload: bytes, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    payload_path = tmp_path / "payload_copy.pkl"
    payload_path.write_bytes(payload)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", LOAD_AND_CALL, str(payload_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- pickling -----------------------------------------------------------------------------------


def test_payload_round_trips_callable_args_and_kwargs():
    payload = cloudpickle.loads(pickle_payload(_train, [4], {"y": 2}))
    assert payload["args"] == (4,)
    assert payload["kwargs"] == {"y": 2}
    assert payload["fn"](*payload["args"], **payload["kwargs"]) == 42


def test_dag_module_is_recognised_as_user_code(dag_module):
    names = {m.__name__ for m in modules_to_pickle_by_value()}
    assert DAG_MODULE_NAME in names
    # Library and own code are not: the stdlib, site-packages, and this provider (shipped as --py-files).
    assert "json" not in names
    assert "cloudpickle" not in names
    assert not any(n.split(".")[0] == "airflow_provider_torchdist" for n in names)


def test_dag_module_is_pickled_by_value(dag_module, tmp_path):
    payload = pickle_payload(dag_module.train, [2], {"offset": 1})
    # The registration is undone afterwards: other pickling in the worker is unaffected.
    assert DAG_MODULE_NAME not in cloudpickle.list_registry_pickle_by_value()

    # The DAG folder and the module are gone: only the pickle is left to rebuild the function.
    sys.modules.pop(DAG_MODULE_NAME)
    shutil.rmtree(tmp_path / "dags")
    result = _load_in_fresh_python(payload, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7"  # helper(2) * SCALE + 1: the helper and the global came along


def test_by_reference_pickle_of_dag_module_would_fail(dag_module, tmp_path):
    """The control for the test above: cloudpickle's default cannot load a DAG function elsewhere."""
    payload = cloudpickle.dumps({"fn": dag_module.train, "args": (2,), "kwargs": {}})
    result = _load_in_fresh_python(payload, tmp_path)
    assert result.returncode != 0
    assert DAG_MODULE_NAME in result.stderr


_ALIAS_BUG = (
    "staging.modules_to_pickle_by_value() lists a module once per sys.modules key and "
    "_by_value() registers/unregisters each entry: a module under two keys is unregistered "
    "twice (cloudpickle raises ValueError 'is not registered for pickle by value'), and one "
    "whose __name__ is not a sys.modules key makes register_pickle_by_value raise ValueError"
)


def test_module_listed_twice_in_sys_modules_still_pickles(dag_module):
    sys.modules["alias_of_the_dag_module"] = dag_module
    try:
        payload = cloudpickle.loads(pickle_payload(dag_module.train, [2], {}))
    finally:
        sys.modules.pop("alias_of_the_dag_module", None)
    assert payload["fn"](*payload["args"]) == 6


def test_module_stored_under_another_name_still_pickles(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("def f():\n    return 5\n")
    spec = importlib.util.spec_from_file_location("name_it_was_built_with", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["key_it_is_stored_under"] = module
    try:
        payload = cloudpickle.loads(pickle_payload(_train, [1], {}))
    finally:
        sys.modules.pop("key_it_is_stored_under", None)
    assert payload["fn"](1) == 10


def test_closure_variable_is_named():
    with pytest.raises(PayloadNotPicklable) as info:
        pickle_payload(_closure_over_lock(), [], {})
    message = str(info.value)
    assert "closure variable 'lock'" in message
    assert "train_with_lock" in message
    assert "lock" in message and "inside the function" in message


def test_global_is_named():
    with pytest.raises(PayloadNotPicklable, match=r"global '_GLOBAL_LOCK' used by _uses_global_lock"):
        pickle_payload(_uses_global_lock, [], {})


def test_unpicklable_positional_argument_is_named():
    with pytest.raises(PayloadNotPicklable, match=r"args\[1\]"):
        pickle_payload(_train, [1, threading.Lock()], {})


def test_unpicklable_keyword_argument_is_named():
    with pytest.raises(PayloadNotPicklable, match=r"kwargs\['x'\]"):
        pickle_payload(_train, [1], {"y": 2, "x": threading.Lock()})


def test_payload_error_is_a_type_error_and_airflow_exception():
    from airflow.providers.common.compat.sdk import AirflowException

    with pytest.raises(PayloadNotPicklable) as info:
        pickle_payload(_train, [threading.Lock()], {})
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, AirflowException)


# -- the staging directory ----------------------------------------------------------------------


def test_stage_callable_is_private_and_complete(tmp_path):
    staged = stage_run(_train, [4], {"y": 2}, base_dir=str(tmp_path), num_processes=2)
    try:
        assert staged.dir.parent == tmp_path
        assert staged.dir.name.startswith("torchdist-")
        assert _mode(staged.dir) == 0o700
        files = list(staged.dir.iterdir())
        assert {f.name for f in files} == {PAYLOAD_FILE, SPEC_FILE, SPARK_ZIP, DRIVER_SCRIPT}
        for f in files:
            assert _mode(f) == 0o600, f"{f.name} has mode {oct(_mode(f))}"

        spec = JobSpec.read(staged.spec_path)
        assert spec == staged.spec
        assert spec.kind == "callable" and spec.entry == PAYLOAD_FILE and spec.num_processes == 2
        assert spec.token and len(spec.token) >= 32
        assert staged.files == [str(staged.dir / PAYLOAD_FILE)]
        assert staged.py_files == str(staged.dir / SPARK_ZIP)

        payload = cloudpickle.loads((staged.dir / PAYLOAD_FILE).read_bytes())
        assert payload["fn"](*payload["args"], **payload["kwargs"]) == 42
    finally:
        staged.cleanup()
    assert not staged.dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_each_run_gets_its_own_directory_and_secret(tmp_path):
    a = stage_run(_train, [1], {}, base_dir=str(tmp_path), num_processes=1)
    b = stage_run(_train, [1], {}, base_dir=str(tmp_path), num_processes=1)
    try:
        assert a.dir != b.dir
        assert a.spec.token != b.spec.token
        assert a.spec.run_id != b.spec.run_id
    finally:
        a.cleanup()
        b.cleanup()


def test_stage_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_bytes(b"print('training')\n")
    base = tmp_path / "staging"
    base.mkdir()
    staged = stage_run(str(script), ["--epochs", 3], {}, base_dir=str(base), num_processes=1)
    try:
        assert staged.spec.kind == "script"
        assert staged.spec.entry == "train.py"
        assert staged.spec.script_args == ["--epochs", "3"]
        assert (staged.dir / "train.py").read_bytes() == script.read_bytes()
        assert _mode(staged.dir / "train.py") == 0o600
    finally:
        staged.cleanup()


def test_missing_script_is_refused_before_staging(tmp_path):
    with pytest.raises(InvalidTrainingConfig, match="does not exist"):
        stage_run(str(tmp_path / "nope.py"), [], {}, base_dir=str(tmp_path), num_processes=1)
    assert list(tmp_path.iterdir()) == []


def test_a_scripts_kwargs_become_its_flags_after_its_args(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    kwargs = {"epochs": 3, "lr": 0.1, "amp": True, "resume": False, "tag": None, "offset": "-2"}
    staged = stage_run(str(script), ["data.csv"], kwargs, base_dir=str(tmp_path), num_processes=1)
    try:
        assert staged.spec.script_args == ["data.csv", "--epochs", "3", "--lr", "0.1", "--amp", "--offset=-2"]
    finally:
        staged.cleanup()
    module = stage_run("-m pkg.train", [], {"epochs": 3}, base_dir=str(tmp_path), num_processes=1)
    try:
        assert module.spec.script_args == ["--epochs", "3"]
    finally:
        module.cleanup()


def test_a_scripts_kwargs_without_one_flag_are_refused_before_staging(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    base = tmp_path / "staging"
    base.mkdir()
    with pytest.raises(
        InvalidTrainingConfig, match=r"kwargs 'layers' is a list.*args=\['--layers', '1', '2'\]"
    ):
        stage_run(str(script), [], {"layers": [1, 2]}, base_dir=str(base), num_processes=1)
    assert list(base.iterdir()) == []


def test_unpicklable_payload_is_refused_before_staging(tmp_path):
    with pytest.raises(PayloadNotPicklable):
        stage_run(_closure_over_lock(), [], {}, base_dir=str(tmp_path), num_processes=1)
    assert list(tmp_path.iterdir()) == []


def test_invalid_spec_field_leaves_nothing_behind(tmp_path):
    with pytest.raises(TypeError):
        stage_run(_train, [], {}, base_dir=str(tmp_path), num_processes=1, no_such_field=1)
    assert list(tmp_path.iterdir()) == []


# -- the --py-files zip -------------------------------------------------------------------------

_AIRFLOW_IMPORT = re.compile(r"^\s*(from\s+airflow(\.|\s)|import\s+airflow(\.|\s|,|$))", re.MULTILINE)


def test_airflow_import_pattern_matches_what_it_must():
    assert _AIRFLOW_IMPORT.search("import airflow\n")
    assert _AIRFLOW_IMPORT.search("    from airflow.sdk import DAG\n")
    assert not _AIRFLOW_IMPORT.search("from airflow_provider_torchdist.spark import x\n")


def test_spark_zip_holds_the_spark_side_without_airflow(tmp_path):
    staged = stage_run(_train, [], {}, base_dir=str(tmp_path), num_processes=1)
    try:
        with zipfile.ZipFile(staged.py_files) as zf:
            names = set(zf.namelist())
            sources = {name: zf.read(name).decode() for name in names}
    finally:
        staged.cleanup()
    # spec.py: TrainingSpec, the base of the JobSpec the driver reads.
    # callbacks/: the framework callbacks run in the ranks' training code.
    expected = {"airflow_provider_torchdist/__init__.py", "airflow_provider_torchdist/spec.py"} | {
        f"airflow_provider_torchdist/{p.relative_to(PACKAGE_DIR).as_posix()}"
        for package in ("spark", "callbacks")
        for p in (PACKAGE_DIR / package).rglob("*.py")
    }
    assert names == expected
    assert "airflow_provider_torchdist/spark/app.py" in names
    assert "airflow_provider_torchdist/callbacks/lightning_report.py" in names
    assert "airflow_provider_torchdist/spark/node/rank.py" in names
    for name, source in sources.items():
        assert not _AIRFLOW_IMPORT.search(source), f"{name} imports airflow"


def test_spark_zip_imports_with_airflow_unavailable(tmp_path):
    """The Spark side, loaded from the zip alone, imports with no Airflow installed."""
    staged = stage_run(_train, [], {}, base_dir=str(tmp_path), num_processes=1)
    zip_copy = tmp_path / "spark.zip"
    shutil.copy(staged.py_files, zip_copy)
    staged.cleanup()
    modules = sorted(
        f"airflow_provider_torchdist.spark.{p.stem}"
        for p in (PACKAGE_DIR / "spark").glob("*.py")
        if p.stem not in ("__init__", "launcher")  # launcher imports torch: slow, and grep covers it
    ) + ["airflow_provider_torchdist.callbacks.scalars"]  # the callbacks' own modules import a framework
    code = textwrap.dedent(
        f"""
        import importlib, sys
        class NoAirflow:
            def find_spec(self, name, path=None, target=None):
                if name == "airflow" or name.startswith("airflow."):
                    raise ImportError("airflow is not installed on the cluster: " + name)
        sys.meta_path.insert(0, NoAirflow())
        sys.path.insert(0, {str(zip_copy)!r})
        for name in {modules!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith({str(zip_copy)!r}), module.__file__
        import airflow_provider_torchdist
        assert not any(m == "airflow" or m.startswith("airflow.") for m in sys.modules)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_an_open_file_is_refused_not_shipped_as_a_silent_copy(tmp_path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("rows")
    with open(data) as f:

        def train():
            return f.read()

        with pytest.raises(
            PayloadNotPicklable,
            match=r"closure variable 'f' of .*an open file \(.*data\.txt'\) cannot travel",
        ):
            pickle_payload(train, [], {})
        with pytest.raises(PayloadNotPicklable, match=r"args\[0\].*an open file"):
            pickle_payload(print, [f], {})


def test_the_standard_streams_travel_as_the_ranks_own() -> None:
    """Not a copy of anything: like cloudpickle, sys.stdout/sys.stderr become the rank's streams.
    (The interpreter's own ones: pytest's capture has replaced sys.stdout and sys.stderr here.)"""
    out = sys.__stderr__

    def train():
        return out

    payload = cloudpickle.loads(pickle_payload(train, [sys.__stdout__], {}))
    assert payload["fn"]() is sys.stderr
    assert payload["args"] == (sys.stdout,)
