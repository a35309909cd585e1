"""The bad-input table (docs/bad-inputs.md), row by row: each bad input gets its clear error, at the
earliest moment it can be known, and before spark-submit ever starts.

Row ids match the table's "test" column. Run-time rows live in tests/integration (named there).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cloudpickle
import pytest
import torch

from airflow_provider_torchdist.errors import (
    InvalidTrainingConfig,
    PayloadNotPicklable,
    SparkSubmitFailed,
    TorchDistributorError,
)
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.results import OutputSignatureError, load_output, to_xcom


def _train(x: int = 1) -> int:
    return x


@pytest.fixture
def no_submit(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail loudly if any hook gets as far as starting spark-submit."""
    started: list[str] = []

    def submit(self, application: str = "", **kwargs) -> None:
        started.append(application)
        raise AssertionError("spark-submit was started for a run that should have been refused")

    monkeypatch.setattr(TorchDistributorHook, "submit", submit)
    return started


def _refused_before_submit(hook: TorchDistributorHook, staging: Path, started: list[str]) -> None:
    assert started == [] and hook._submit_sp is None  # spark-submit never ran
    assert not staging.exists() or list(staging.iterdir()) == []  # nothing staged, or staged and removed


# -- DAG parse time: the operator's constructor ---------------------------------------------------

PARSE_TIME = [
    pytest.param(
        {"num_processes": "abc"}, r"num_processes must be an integer >= 1, got 'abc'", id="num_processes-abc"
    ),
    pytest.param({"num_processes": 0}, r"num_processes must be an integer >= 1, got 0", id="num_processes-0"),
    pytest.param(
        {"num_processes": 2.5}, r"num_processes must be an integer >= 1, got 2\.5", id="num_processes-2.5"
    ),
    pytest.param(
        {"local_mode": "maybe"}, r"local_mode must be True or False, got 'maybe'", id="local_mode-maybe"
    ),
    pytest.param({"use_gpu": 1}, r"use_gpu must be True or False, got 1", id="use_gpu-1"),
    pytest.param({"args": "0.1"}, r"args must be a list, got str: '0\.1'", id="args-str"),
    pytest.param({"args": 5}, r"args must be a list, got int", id="args-int"),
    pytest.param({"kwargs": [("lr", 0.1)]}, r"kwargs must be a dict, got list", id="kwargs-list"),
    pytest.param({"kwargs": {1: 2}}, r"kwargs keys must be strings", id="kwargs-int-keys"),
    pytest.param(
        {"train_object": 42},
        r"train_object must be a callable or the path of a \.py training script, got int: 42",
        id="train_object-int",
    ),
    pytest.param(
        {"num_processes": 3, "nproc_per_node": 2},
        r"num_processes=3 is not divisible by nproc_per_node=2.*Use e\.g\. num_processes=2",
        id="nproc_per_node-not-dividing",
    ),
    pytest.param(
        {"max_restarts": -1}, r"max_restarts must be an integer >= 0, got -1", id="max_restarts-negative"
    ),
    pytest.param(
        {"spark_submit_kwargs": {"deploy_mode": "cluster"}},
        r"deploy_mode='cluster' is not supported.*pass deploy_mode='client'",
        id="deploy_mode-cluster",
    ),
    pytest.param(
        {"conf": {"spark.ssl.enabled": "true"}},
        r"spark\.ssl\.enabled=true, but torch\.distributed traffic.*pass allow_unencrypted=True",
        id="ssl-without-allow_unencrypted",
    ),
]


@pytest.mark.parametrize("kwargs, message", PARSE_TIME)
def test_refused_when_the_dag_is_parsed(kwargs: dict, message: str, no_submit: list[str]) -> None:
    with pytest.raises(InvalidTrainingConfig, match=message):
        TorchDistributorOperator(task_id="train", **{"train_object": _train, **kwargs})
    assert no_submit == []


def test_ssl_with_allow_unencrypted_is_accepted() -> None:
    TorchDistributorOperator(
        task_id="train", train_object=_train, conf={"spark.ssl.enabled": "true"}, allow_unencrypted=True
    )


class _TI:
    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "train", -1, 1

    def xcom_push(self, key: str, value: object) -> None:
        pass


def test_templated_num_processes_rendering_to_abc_is_refused_before_the_hook(no_submit: list[str]) -> None:
    op = TorchDistributorOperator(task_id="train", train_object=_train, num_processes="{{ params.n }}")
    op.render_template_fields({"params": {"n": "abc"}})
    assert op.num_processes == "abc"
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes must be an integer >= 1, got 'abc'"):
        op.execute({"ti": _TI()})
    assert op._hook is None and no_submit == []  # refused before any hook, let alone spark-submit


# -- at the start of the task, before spark-submit: the hook -------------------------------------


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    path = tmp_path / "staging"
    path.mkdir()
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once this socket is closed


def test_unknown_connection_id(no_submit: list[str]) -> None:
    with pytest.raises(InvalidTrainingConfig, match=r"Spark connection 'no_such_spark' is not defined") as e:
        TorchDistributorHook(conn_id="no_such_spark")
    assert "AIRFLOW_CONN_NO_SUCH_SPARK" in str(e.value)  # says how to define it


def test_deploy_mode_cluster_from_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://127.0.0.1:7077?deploy-mode=cluster")
    with pytest.raises(InvalidTrainingConfig, match=r"deploy_mode='cluster' is not supported.*client"):
        TorchDistributorHook()


def test_missing_script(tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"train_object script '.*nope\.py' does not exist"):
        hook.run(str(tmp_path / "nope.py"))
    _refused_before_submit(hook, staging, no_submit)


def test_script_with_kwargs(tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"kwargs apply to callables only.*args=\['--epochs'"):
        hook.run(str(script), epochs=3)
    _refused_before_submit(hook, staging, no_submit)


def test_unpicklable_callable_closing_over_a_lock(staging: Path, no_submit: list[str]) -> None:
    lock = threading.Lock()

    def train_with_lock() -> int:
        with lock:
            return 1

    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(
        PayloadNotPicklable, match=r"closure variable 'lock'.*create locks.*inside the function"
    ):
        hook.run(train_with_lock)
    _refused_before_submit(hook, staging, no_submit)


def test_unpicklable_argument(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(PayloadNotPicklable, match=r"Cannot pickle the training payload: args\[0\] \(lock\)"):
        hook.run(_train, threading.Lock())
    with pytest.raises(PayloadNotPicklable, match=r"kwargs\['x'\] \(lock\)"):
        hook.run(_train, x=threading.Lock())
    _refused_before_submit(hook, staging, no_submit)


def test_unreachable_master_fails_fast(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    port = _closed_port()
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", f"spark://127.0.0.1:{port}")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    started = time.monotonic()
    with pytest.raises(
        SparkSubmitFailed, match=rf"Cannot reach the Spark master spark://127\.0\.0\.1:{port}"
    ) as e:
        hook.run(_train)
    assert time.monotonic() - started < 10  # not Spark's 3 x 20 s of registration retries
    assert "refused" in str(e.value) and "'spark_default'" in str(e.value)  # why, and which connection
    _refused_before_submit(hook, staging, no_submit)


@pytest.mark.parametrize("how", ["spark_binary", "PATH"])
def test_missing_spark_submit(how: str, tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    kwargs = (
        {"spark_binary": str(tmp_path / "no-spark" / "spark-submit")}
        if how == "spark_binary"
        else {"env_vars": {"PATH": str(tmp_path)}}  # a PATH without spark-submit on it
    )
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging), **kwargs)
    with pytest.raises(SparkSubmitFailed, match=r"spark-submit not found.*Install pyspark"):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_on_the_embedded_master(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(
        InvalidTrainingConfig, match=r"use_gpu=True in distributed mode needs a cluster.*local_mode=True"
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_on_a_cluster_without_spark_gpu_settings(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://127.0.0.1:7077")
    hook = TorchDistributorHook(num_processes=2, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"spark\.executor\.resource\.gpu\.amount.*use_gpu=False"):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_in_local_mode_without_gpus(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine: no GPU
    hook = TorchDistributorHook(num_processes=2, local_mode=True, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(
        InvalidTrainingConfig, match=r"needs 2 GPU\(s\) on the driver.*torch sees 0.*use_gpu=False"
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_ssl_enabled_without_allow_unencrypted(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, conf={"spark.ssl.enabled": "true"}, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"spark\.ssl\.enabled=true.*allow_unencrypted=True"):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


class _FakeMaster(BaseHTTPRequestHandler):
    """A standalone master's web UI: two alive workers of 2 cores each."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps(
            {"workers": [{"state": "ALIVE", "cores": 2}, {"state": "ALIVE", "cores": 2}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_too_many_processes_for_the_cluster(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeMaster)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        conn = {
            "conn_type": "spark",
            "host": "spark://127.0.0.1",
            "port": port,  # answers TCP, like a master would
            "extra": {"master-web-ui": f"http://127.0.0.1:{port}"},
        }
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))
        hook = TorchDistributorHook(num_processes=6, staging_dir=str(staging))
        with pytest.raises(
            InvalidTrainingConfig,
            match=r"needs 6 task slot\(s\).*never offer more than 4.*Lower num_processes",
        ):
            hook.run(_train)
    finally:
        server.shutdown()
        server.server_close()
    _refused_before_submit(hook, staging, no_submit)


# -- downstream, when the output is loaded --------------------------------------------------------


def test_envelope_from_another_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-a")
    envelope = to_xcom(cloudpickle.dumps(torch.arange(3)))
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-b")
    with pytest.raises(OutputSignatureError, match=r"another \[torchdist\] output_signing_key.*Re-run"):
        load_output(envelope)


def test_every_error_here_is_one_of_the_providers() -> None:
    # Airflow fails the task on them; callers can catch the provider's base class.
    for error in (InvalidTrainingConfig, PayloadNotPicklable, SparkSubmitFailed):
        assert issubclass(error, TorchDistributorError)


def test_master_check_accepts_any_reachable_master_of_a_standalone_ha_list() -> None:
    from airflow_provider_torchdist.preflight import check_master_reachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_master_reachable(f"spark://127.0.0.1:{_closed_port()},127.0.0.1:{port}", "spark_default")
    check_master_reachable("local[2]", "spark_default")  # not a standalone master: nothing to check
    with pytest.raises(
        SparkSubmitFailed, match=r"spark://10\.0\.0\.1 \(10\.0\.0\.1: no port, write spark://host:7077\)"
    ):
        check_master_reachable("spark://10.0.0.1", "spark_default")
