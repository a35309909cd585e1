"""Private files and directories: written whole and 0600; a node's directory made after removing
those whose process is dead (a Spark Python worker killed with SIGKILL leaves its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from airflow_provider_torchdist.spark.wire.private_files import private_directory, write_private_text


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("prefix", ["torchdist-connect-", "torchdist-data-"])
def test_a_new_directory_is_private_and_the_dead_ones_go_first(temp_dir: Path, prefix: str) -> None:
    dead = temp_dir / f"{prefix}{dead_pid()}-abc"
    (dead / "logs").mkdir(parents=True)
    (dead / "payload.pkl").write_bytes(b"the killed worker's payload")
    alive = temp_dir / f"{prefix}{os.getppid()}-def"  # a live process's (pytest's parent)
    alive.mkdir()
    other = temp_dir / f"{prefix}notapid-ghi"
    other.mkdir()
    elsewhere = temp_dir / "elsewhere"
    elsewhere.mkdir()
    link = temp_dir / f"{prefix}{dead_pid()}-jkl"
    link.symlink_to(elsewhere)

    made = Path(private_directory(prefix))

    assert made.parent == temp_dir and made.name.startswith(f"{prefix}{os.getpid()}-")
    assert made.stat().st_mode & 0o777 == 0o700
    assert not dead.exists()
    assert alive.is_dir() and other.is_dir() and link.is_symlink() and elsewhere.is_dir()


def test_a_private_file_is_written_whole_and_owner_only(tmp_path: Path) -> None:
    path = write_private_text(tmp_path / "secret.json", '{"k": 1}')
    assert path.read_text() == '{"k": 1}' and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret.json"]  # no partial file left


def test_a_directory_its_process_removes_during_the_sweep_is_passed_over(
    temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Python workers of one Connect server: one sweeps while the other removes its own
    directory (its task's ``finally``), right after the sweep's first look at it; the sweep must
    not raise (stop 40's CI: ``FileNotFoundError`` from the task, a failed run)."""
    gone = temp_dir / f"torchdist-connect-{dead_pid()}-gone"
    gone.mkdir()

    def then_removed(name: str):
        real = getattr(Path, name)

        def look(self: Path, *args, **kwargs):
            answer = real(self, *args, **kwargs)
            if self == gone:
                shutil.rmtree(gone, ignore_errors=True)
            return answer

        return look

    for name in ("is_dir", "stat", "lstat"):
        monkeypatch.setattr(Path, name, then_removed(name))

    made = Path(private_directory("torchdist-connect-"))

    assert made.is_dir() and not gone.exists()


def test_a_name_whose_number_is_no_possible_pid_is_left_and_does_not_fail(temp_dir: Path) -> None:
    """``os.kill`` raises OverflowError, not OSError, for a number past the PID range."""
    huge = temp_dir / "torchdist-data-99999999999999999999999-abc"
    huge.mkdir()

    made = Path(private_directory("torchdist-data-"))

    assert made.is_dir() and huge.is_dir()
