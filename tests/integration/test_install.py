"""A new user's install, as the README gives it: plain pip, no constraints, no scripts/install.

One fresh venv, in two steps (one venv and one resolution's downloads for both: each step
resolves the whole of Airflow and Spark from the index, about a minute of CPU):

1. ``pip install ".[spark]"`` into a venv that already has another torch, inside the range, keeps
   it: a stand-in distribution named ``torch`` at 2.99.0, a version no pin could match, built here.
   pip resolves the install for real and reports what it would install (``--dry-run --report``),
   which is what this is about, without laying down Airflow and Spark twice.
2. Then, as the README gives it, ``pip install torch==2.13.0`` then ``pip install ".[spark]"``
   gives a working ``spark-submit`` (``doctor`` says ready) and runs ``dags/example_torchdist.py``
   end to end.

It installs from a copy of this checkout's files (what git tracks or would track), so the checkout
gets no ``build/``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 900


def _source_copy(dest: Path) -> Path:
    """This checkout's files, tracked or not ignored, as a user's clone would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _pip_install(
    python: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    # pip as a user runs it, less its bytecode step: pip compiles every file it lays down, one at a
    # time (torch, Airflow and pyspark: over a minute here), where a user's Python writes the .pyc of
    # what a run imports as it goes. The example run below lets it: CI sets
    # PYTHONDONTWRITEBYTECODE, which a user's shell does not.
    env = {**(env or os.environ), "PIP_NO_COMPILE": "1"}
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
    )
    assert done.returncode == 0, (
        f"pip install {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )


def _installed(python: Path, dist: str) -> str:
    return subprocess.run(
        [str(python), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _stand_in_torch(dest: Path, version: str) -> Path:
    """A minimal wheel named torch: enough for pip to see an installed torch of that version."""
    files = {
        "torch/__init__.py": f'__version__ = "{version}"\n'.encode(),
        f"torch-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n".encode(),
        f"torch-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    record.append(f"torch-{version}.dist-info/RECORD,,")
    files[f"torch-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = dest / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


# Two resolutions, an install and an example run; each step has its own bound (INSTALL_TIMEOUT, ...).
@pytest.mark.timeout(1800)
def test_an_installed_torch_in_the_range_is_kept_then_the_one_command_install_runs_the_example_dag(
    tmp_path: Path, no_leftovers: None
) -> None:
    source = _source_copy(tmp_path / "src")
    python = _venv(tmp_path / "venv")
    _torch_in_the_range_is_kept(python, source, tmp_path)

    _pip_install(python, "torch==2.13.0")  # (the stand-in goes: an explicit pin replaces it)
    assert _installed(python, "torch").startswith("2.13.0")  # (+cpu here: the CPU build)
    _pip_install(python, ".[spark]", cwd=source)
    _example_dag_runs(python, source, tmp_path)


def _torch_in_the_range_is_kept(python: Path, source: Path, tmp_path: Path) -> None:
    # This machine's pip config caps torch at the builds on its disk; a user's pip has no such cap.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    _pip_install(python, "--no-index", str(_stand_in_torch(tmp_path, "2.99.0")), env=env)
    assert _installed(python, "torch") == "2.99.0"

    report = tmp_path / "report.json"
    _pip_install(python, "--dry-run", "--report", str(report), ".[spark]", cwd=source, env=env)

    plan = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "torch" not in plan, f"pip would replace the torch that satisfied the range: {plan.get('torch')}"
    assert plan["airflow-provider-torchdist"] == "0.1.0"
    assert "apache-airflow" in plan and plan["pyspark"] == plan["pyspark-client"], plan


def _example_dag_runs(python: Path, source: Path, tmp_path: Path) -> None:
    bin_dir = python.parent
    assert (bin_dir / "spark-submit").exists(), "the [spark] extra gave no spark-submit"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(source / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's shell: imports leave their .pyc behind
    doctor = subprocess.run(
        [str(python), "-m", "airflow_provider_torchdist", "doctor"], env=env, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok      Spark versions:" in doctor.stdout

    subprocess.run(
        [str(bin_dir / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300
    )
    run = subprocess.run(
        [str(bin_dir / "airflow"), "dags", "test", "example_torchdist"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "state=success" in log, log[-6000:]
    assert "RANK0_RESULT {'rank': 0, 'world_size': 2" in log, log[-6000:]
