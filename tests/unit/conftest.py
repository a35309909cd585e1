"""Shared set-up for the unit tests: an isolated Airflow home and no Spark connection.

The environment is set when this module is imported, i.e. before any test module imports Airflow,
so no test reads or writes the user's ~/airflow or picks up a configured ``spark_default``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

_AIRFLOW_HOME = tempfile.mkdtemp(prefix="torchdist-unit-airflow-home-")
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)


@pytest.fixture(autouse=True)
def _no_spark_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without a Spark connection; a test that needs one sets it itself."""
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def fast_shutdown(channel):
    """Make a RunChannel poll for shutdown every 10 ms instead of socketserver's 0.5 s (fast tests)."""
    channel._thread = threading.Thread(
        target=channel._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
    )
    return channel
