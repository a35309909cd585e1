"""The mlflow connection: its URI and credentials, the start-of-task check against real sockets (a
port nobody listens on, a server that refuses the credentials), and the parse-time check that the
MLflow client is installed."""

from __future__ import annotations

import http.server
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow.models.connection import Connection

from airflow_provider_torchdist.errors import InvalidTrainingConfig, TrackingUnavailable
from airflow_provider_torchdist.operators.tracking.connection import (
    TrackingTarget,
    connect,
    target_of,
    tracking_uri,
)


def test_the_host_is_the_tracking_uri_a_bare_host_gets_http_and_the_port() -> None:
    assert tracking_uri("http://mlflow.internal:5000", None, None) == "http://mlflow.internal:5000"
    assert tracking_uri("https://mlflow.example.com/", None, None) == "https://mlflow.example.com"
    assert tracking_uri("mlflow.internal", 5000, None) == "http://mlflow.internal:5000"
    assert tracking_uri("http://mlflow.internal", 5000, None) == "http://mlflow.internal:5000"
    with pytest.raises(InvalidTrainingConfig, match="no host"):
        tracking_uri("", None, None)


def test_login_password_and_token_become_mlflows_credentials_never_printed() -> None:
    connection = Connection(
        conn_id="mlflow_x",
        conn_type="mlflow",
        host="http://mlflow:5000",
        login="ci",
        password="s3cret-pass",
        extra='{"token": "tok-123", "experiment_name": "retrain"}',
    )
    target = target_of(connection)
    assert (target.uri, target.experiment_name) == ("http://mlflow:5000", "retrain")
    assert target.auth_env() == {
        "MLFLOW_TRACKING_USERNAME": "ci",
        "MLFLOW_TRACKING_PASSWORD": "s3cret-pass",
        "MLFLOW_TRACKING_TOKEN": "tok-123",
    }
    assert "s3cret" not in repr(target) and "tok-123" not in repr(target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tracking_uri_nobody_answers_on_fails_at_once_naming_it() -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingUnavailable, match="did not answer") as raised:
        connect(TrackingTarget(uri))
    assert uri in str(raised.value) and "nothing was submitted" in str(raised.value)


class Refusing(http.server.BaseHTTPRequestHandler):
    """A tracking server that refuses every request's credentials, as MLflow's basic-auth app does."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
        self.end_headers()
        self.wfile.write(b"You are not authenticated.")

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_refused_credentials_are_said_as_such(refusing_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrackingUnavailable, match="refused the credentials"):
        connect(TrackingTarget(refusing_server, username="ci", password="wrong"))


def test_without_the_mlflow_client_an_mlflow_conn_id_fails_the_dag_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what Python's import system sees when it is absent
    with pytest.raises(InvalidTrainingConfig, match=r'pip install "airflow-provider-torchdist\[mlflow\]"'):
        TorchDistributorOperator(task_id="train", train_object=print, mlflow_conn_id="mlflow_default")
    # Without a connection nothing needs it.
    TorchDistributorOperator(task_id="train2", train_object=print)


def test_the_torchdist_default_connection_is_taken_when_the_operator_sets_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

    monkeypatch.setenv("AIRFLOW__TORCHDIST__MLFLOW_CONN_ID", "mlflow_team")
    assert TorchDistributorOperator(task_id="t", train_object=print).mlflow_conn_id == "mlflow_team"
    assert TorchDistributorOperator(task_id="u", train_object=print, mlflow_conn_id="x").mlflow_conn_id == "x"


@pytest.mark.parametrize("server", ["nobody", "refusing"])
def test_a_bad_uri_or_refused_credentials_fail_the_task_before_anything_is_submitted(
    server: str, refusing_server: str, monkeypatch: pytest.MonkeyPatch, no_submit: list[str]
) -> None:
    import json

    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
    from tests.unit.conftest import FakeTI

    uri = refusing_server if server == "refusing" else f"http://127.0.0.1:{free_port()}"
    connection = {"conn_type": "mlflow", "host": uri, "login": "ci", "password": "wrong-password"}
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_CI", json.dumps(connection))
    operator = TorchDistributorOperator(task_id="train", train_object=print, mlflow_conn_id="mlflow_ci")
    expected = "refused the credentials" if server == "refusing" else "did not answer"
    with pytest.raises(TrackingUnavailable, match=expected):
        operator.execute({"ti": FakeTI()})
    assert no_submit == []  # spark-submit never started


class Answering(http.server.BaseHTTPRequestHandler):
    """A tracking server that takes any credentials and has no experiments."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b'{"experiments": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def own_environ() -> Iterator[None]:
    """``os.environ`` as it was, once the test is over (``connect`` sets the credentials in it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_mlflow_credentials_never_reach_the_supervisor_or_spark_submit(
    own_environ: None, tmp_path: Path
) -> None:
    """``connect`` puts the credentials in the task's environment, where MLflow's client reads them;
    the task's children that run Spark (a new supervisor, spark-submit, and so its driver and
    local ranks) must not inherit them. Before, every one of them did."""
    from airflow_provider_torchdist.submit.checks import build_spec
    from airflow_provider_torchdist.submit.connection import resolve_target
    from airflow_provider_torchdist.submit.plan import build_plan
    from airflow_provider_torchdist.submit.spark_submit import Submission
    from airflow_provider_torchdist.supervision.launch import supervisor_environment

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = TrackingTarget(
            f"http://127.0.0.1:{server.server_address[1]}",
            username="ci",
            password="pw-9f3a1c",
            token="tok-77b2e0",
        )
        connect(target)  # the task's own client works with them...
    finally:
        server.shutdown()
        server.server_close()
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw-9f3a1c"
    assert not {"pw-9f3a1c", "tok-77b2e0"} & set(supervisor_environment(os.environ).values())
    # ...and a real Submission's spark-submit (a script that writes its environment) sees none.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "spark-submit").write_text('#!/bin/sh\nfor a; do last="$a"; done\nenv > "$last"\n')
    (bin_dir / "spark-submit").chmod(0o755)
    spec = build_spec()
    plan = build_plan(
        spec,
        resolve_target(spec),
        application="/stage/torchdist_driver.py",
        application_args=[str(tmp_path / "env.txt")],
        files=[],
        py_files=[],
        properties={},
        properties_dir=tmp_path,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    Submission(plan).run()
    seen = (tmp_path / "env.txt").read_text()
    assert "PATH=" in seen and "pw-9f3a1c" not in seen and "tok-77b2e0" not in seen
