"""The lowest versions this package supports (constraints-lowest.txt: Airflow 3.0.0, the Spark
provider 6.0.0, ...): ``scripts/test-lowest`` builds ./.venv-lowest with them, runs the unit tests
there and one embedded run of dags/example_torchdist.py.

It runs here, as one unit of the integration suite, rather than before it in scripts/test: it is
a few minutes of installs and waits that fit beside the shared deployment's tests (conftest.py's
LONGEST_FIRST), not in front of them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: Measured at about 3 min alone and 5 under a CPU hog; the install is most of it.
TIMEOUT_S = 1200


# An install, the unit tests and an embedded run in another environment; its own bound is TIMEOUT_S.
@pytest.mark.timeout(1500)
def test_the_lowest_supported_versions_pass_the_unit_tests_and_the_example_run(tmp_path: Path) -> None:
    # The script's own environment, as a shell would give it: none of this pytest's (its xdist
    # worker's name, the session's AIRFLOW_HOME), which would steer the nested pytest and Airflow.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "AIRFLOW_", "AIRFLOW__", "VIRTUAL_ENV"))
    }
    log = tmp_path / "test-lowest.log"
    with log.open("w") as out:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "test-lowest")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S,
        )
    output = log.read_text()
    assert done.returncode == 0, f"scripts/test-lowest exited {done.returncode}:\n{output[-8000:]}"
    assert "test-lowest: example_torchdist succeeded" in output, output[-3000:]
