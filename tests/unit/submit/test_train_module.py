"""Module mode (``train_object="-m pkg.mod"``) and ``py_files``: the form, staging, shipping and
the early importability check; the rank's side runs the module as ``python -m`` would."""

from __future__ import annotations

import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorOperator
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.node.rank import call_entry
from airflow_provider_torchdist.submit.checks import build_spec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.prepare import plan_staged
from airflow_provider_torchdist.submit.py_files import check_module_importable, stage_py_files, zip_directory
from airflow_provider_torchdist.submit.staging import stage_run
from airflow_provider_torchdist.submit.train_module import module_name


def _package(root: Path, name: str = "mypkg") -> Path:
    pkg = root / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "train.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            from pathlib import Path
            Path(os.environ["MARK"]).write_text(" ".join(sys.argv[1:]) + "|" + __name__)
            """
        )
    )
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    return pkg


@pytest.mark.parametrize(
    "value, name", [("-m pkg", "pkg"), ("-m pkg.sub.train", "pkg.sub.train"), ("/a/-m.py", None)]
)
def test_module_mode_names_a_dotted_module(value, name) -> None:
    assert module_name(value) == name


@pytest.mark.parametrize(
    "value",
    [
        "-m",
        "-m ",
        "-mpkg",
        "-m  pkg",
        "-m pkg.train --lr 1",
        "-m pkg/train.py",
        "-m pkg..x",
        "-m 1pkg",
        "-m pkg.class",
    ],
)
def test_a_near_miss_of_module_mode_fails_when_the_dag_is_parsed(value) -> None:
    with pytest.raises(InvalidTrainingConfig, match="is not module mode: write exactly '-m', one space"):
        TorchDistributorOperator(task_id="t", train_object=value)


def test_a_module_takes_args_then_kwargs_as_flags_as_its_argv(tmp_path) -> None:
    staged = stage_run("-m mypkg.sub.train", ["--lr", 0.5], {}, base_dir=str(tmp_path))
    try:
        assert (staged.spec.kind, staged.spec.entry, staged.spec.script_args) == (
            "module",
            "mypkg.sub.train",
            ["--lr", "0.5"],
        )
        assert staged.files == []  # nothing shipped: the module is imported on the ranks
    finally:
        staged.cleanup()
    staged = stage_run(
        "-m mypkg.sub.train", ["--x"], {"lr": 1, "verbose": True, "quiet": False}, base_dir=str(tmp_path)
    )
    try:
        assert staged.spec.script_args == ["--x", "--lr", "1", "--verbose"]
    finally:
        staged.cleanup()


def test_a_package_directory_is_zipped_as_the_package_and_any_other_as_a_source_root(tmp_path) -> None:
    pkg = _package(tmp_path / "src")
    (tmp_path / "src" / "helpers.py").write_text("X = 1\n")
    as_package = zip_directory(pkg, tmp_path / "p.zip")
    as_root = zip_directory(tmp_path / "src", tmp_path / "r.zip")
    assert sorted(zipfile.ZipFile(as_package).namelist()) == [
        "mypkg/__init__.py",
        "mypkg/sub/__init__.py",
        "mypkg/sub/train.py",
    ]
    assert "helpers.py" in zipfile.ZipFile(as_root).namelist()
    assert "mypkg/sub/train.py" in zipfile.ZipFile(as_root).namelist()
    assert oct(as_package.stat().st_mode & 0o777) == "0o600"


def test_py_files_entries_are_checked_before_spark_submit(tmp_path) -> None:
    (tmp_path / "a.zip").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    staging = tmp_path / "staging"
    staging.mkdir()
    assert stage_py_files([str(tmp_path / "a.zip")], staging) == [str(tmp_path / "a.zip")]
    with pytest.raises(InvalidTrainingConfig, match="does not exist on this worker"):
        stage_py_files([str(tmp_path / "missing")], staging)
    with pytest.raises(InvalidTrainingConfig, match=r"is not a \.py, \.zip or \.egg file"):
        stage_py_files([str(tmp_path / "notes.txt")], staging)


def test_spark_submit_kwargs_py_files_are_merged_into_the_setting() -> None:
    spec = build_spec(**{"py_files": ["/a.zip"], "spark_submit_kwargs": {"py_files": "/b.py, /c.egg"}})
    assert spec.py_files == ["/a.zip", "/b.py", "/c.egg"]
    assert "py_files" not in spec.spark_submit_kwargs
    with pytest.raises(InvalidTrainingConfig, match="py_files must be a list of paths"):
        build_spec(**{"py_files": [""]})


def test_a_module_is_found_in_py_files_without_importing_it(tmp_path) -> None:
    pkg = _package(tmp_path / "src")
    zipped = str(zip_directory(pkg, tmp_path / "p.zip"))
    check_module_importable("mypkg.sub.train", [zipped])
    check_module_importable("mypkg.sub.train", [str(tmp_path / "src")])
    check_module_importable("json.decoder", [])  # on this Python's own path
    assert "mypkg" not in sys.modules
    for missing in ("mypkg.sub.nope", "nope.train"):
        with pytest.raises(InvalidTrainingConfig, match=f"module '{missing}' cannot be found"):
            check_module_importable(missing, [zipped])


def test_a_module_nowhere_fails_before_spark_submit_where_ranks_run_here(tmp_path) -> None:
    spec = build_spec(**{"local_mode": True, "num_processes": 2})
    staged = stage_run("-m nope.train", [], {}, base_dir=str(tmp_path), training=spec)
    try:
        target = SparkTarget(master="local[2]", connection={}, embedded=True)
        with pytest.raises(InvalidTrainingConfig, match="'nope.train' cannot be found"):
            plan_staged(spec, target, staged, {}, {})
    finally:
        staged.cleanup()


def test_the_rank_runs_the_module_as_main_with_its_argv(tmp_path, monkeypatch) -> None:
    _package(tmp_path / "src")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("MARK", str(tmp_path / "mark"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    staged = stage_run("-m mypkg.sub.train", ["--lr", "0.5"], {}, base_dir=str(tmp_path))
    try:
        assert call_entry(staged.spec, "unused") is None
    finally:
        staged.cleanup()
    assert (tmp_path / "mark").read_text() == "--lr 0.5|__main__"
    missing = stage_run("-m mypkg.nope", [], {}, base_dir=str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError, match="ship it with py_files"):
            call_entry(missing.spec, "unused")
    finally:
        missing.cleanup()


def test_py_files_entries_that_would_break_or_leak_are_refused(tmp_path, monkeypatch) -> None:
    staging = tmp_path / "stage"
    staging.mkdir()
    pkg = _package(tmp_path / "src")
    monkeypatch.chdir(tmp_path / "src")
    with pytest.raises(InvalidTrainingConfig, match="is not an absolute path"):
        stage_py_files(["mypkg"], staging)
    with pytest.raises(InvalidTrainingConfig, match="would zip its own zip"):
        stage_py_files([str(tmp_path)], staging)  # the staging directory is inside it
    (tmp_path / "secret").write_text("SECRET")
    (pkg / "leak.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidTrainingConfig, match="symbolic link that leads out of it"):
        stage_py_files([str(pkg)], staging)
    (pkg / "leak.txt").unlink()
    (tmp_path / "a,b.py").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.zip").write_bytes(b"")
    (tmp_path / "b.zip").write_bytes(b"")
    for entries, why in (
        ([str(tmp_path / "a,b.py")], "contains ',' or '#'"),
        ([str(tmp_path / "b.zip"), str(tmp_path / "other" / "b.zip")], "the name of another entry"),
    ):
        with pytest.raises(InvalidTrainingConfig, match=why):
            stage_py_files(entries, staging)
    (pkg / ".git").mkdir()
    (pkg / ".git" / "config").write_text("")
    names = zipfile.ZipFile(stage_py_files([str(pkg)], staging)[0]).namelist()
    assert not any(".git" in n for n in names) and "mypkg/sub/train.py" in names


def test_a_single_py_file_is_a_module_and_main_is_not_one(tmp_path) -> None:
    (tmp_path / "trainmod.py").write_text("")
    check_module_importable("trainmod", [str(tmp_path / "trainmod.py")])
    with pytest.raises(InvalidTrainingConfig, match="is not module mode"):
        TorchDistributorOperator(task_id="t", train_object="-m __main__")
