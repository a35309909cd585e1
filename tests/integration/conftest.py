"""Shared set-up for the integration tests: an isolated Airflow home, and leftover-process checks."""

from __future__ import annotations

import os
import time

import psutil
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session", autouse=True)
def isolated_airflow_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Keep the tests away from the user's ~/airflow and from any configured Spark connection."""
    home = str(tmp_path_factory.mktemp("airflow_home"))
    os.environ["AIRFLOW_HOME"] = home
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)
    return home


@pytest.fixture
def no_leftovers():
    """Fail the test if any process it started (spark-submit, driver, agents, ranks) outlives it."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left running: {[(p.pid, ' '.join(p.cmdline())[:200]) for p in left]}"
