"""``python -m airflow_provider_torchdist doctor``: each check says what is missing and what to do."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow_provider_torchdist import doctor


def test_this_environment_is_ready(capsys) -> None:
    assert doctor.main() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for what in ("spark-submit", "Spark jars", "Spark versions", "Java", "torch", "signing key", "Airflow"):
        assert f"ok      {what}:" in out
    assert out.strip().endswith("ready to train")


def test_no_spark_submit_is_named_with_what_to_do(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    finding = doctor._spark_submit()
    assert not finding.ok and "install the full pyspark" in finding.detail


def test_pyspark_client_without_jars_is_told_apart(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPARK_HOME", str(tmp_path))
    finding = doctor._spark_jars()
    assert (
        not finding.ok
        and "pyspark-client" in finding.detail
        and "airflow-provider-torchdist[spark]" in finding.detail
    )


def _fake_pyspark(root, *, python_side: str, jars: str) -> None:
    folder = root / "pyspark"
    (folder / "jars").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "version.py").write_text(f'__version__: str = "{python_side}"\n')
    (folder / "jars" / f"spark-core_2.13-{jars}.jar").write_bytes(b"")


def test_a_pyspark_folder_of_two_spark_releases_is_named(monkeypatch, tmp_path) -> None:
    """pyspark-client of another release laid over the full pyspark: Python and jars disagree."""
    _fake_pyspark(tmp_path, python_side="4.2.0", jars="4.3.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pyspark", raising=False)
    finding = doctor._spark_versions()
    assert not finding.ok
    assert "pyspark/version.py 4.2.0" in finding.detail and "jars 4.3.0" in finding.detail
    assert "same release" in finding.detail


def test_one_spark_release_everywhere_is_fine() -> None:
    finding = doctor._spark_versions()
    assert finding.ok, finding.detail


def test_no_java_is_named(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    finding = doctor._java()
    assert not finding.ok and "install Java 17" in finding.detail


def test_a_key_file_others_can_read_is_a_problem(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "")
    assert doctor._signing_key().ok  # none yet: made on the first run
    key = tmp_path / "torchdist_output_signing.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)
    finding = doctor._signing_key()
    assert not finding.ok and "mode 0600" in finding.detail


def test_a_broken_check_is_a_finding_and_the_exit_code_says_so(monkeypatch, capsys) -> None:
    def broken() -> doctor.Finding:
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "CHECKS", (broken,))
    assert doctor.main() == 1
    assert "MISSING broken: RuntimeError: boom" in capsys.readouterr().out


def test_the_command_line() -> None:
    usage = subprocess.run(
        [sys.executable, "-m", "airflow_provider_torchdist"], capture_output=True, text=True
    )
    assert usage.returncode == 2 and "usage: python -m airflow_provider_torchdist doctor" in usage.stderr


def test_a_connect_only_worker_is_checked_for_the_connect_client_not_spark_submit_java_or_torch(
    capsys,
) -> None:
    assert doctor.main(["--connect"]) == 0
    out = capsys.readouterr().out
    assert "ok      Spark Connect client: pyspark " in out
    assert [f.what for f in doctor.run_checks(connect=True)] == [
        "Spark Connect client",
        "signing key",
        "Airflow",
        "Spark connection",
    ]


# -- the Spark connection a run would use: real connections (AIRFLOW_CONN_*), real sockets ----------


@contextmanager
def standalone_master(workers: list[dict[str, Any]]) -> Iterator[tuple[int, str]]:
    """A listening master port, and a web UI that serves ``/json/`` as a standalone master does."""
    state = json.dumps({"status": "ALIVE", "workers": workers}).encode()

    class MasterUI(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            found = self.path == "/json/"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(state if found else b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    ui = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MasterUI)
    threading.Thread(target=ui.serve_forever, daemon=True).start()
    with socket.create_server(("127.0.0.1", 0)) as master:
        try:
            yield master.getsockname()[1], f"http://127.0.0.1:{ui.server_address[1]}"
        finally:
            ui.shutdown()
            ui.server_close()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def spark_default(monkeypatch, host: str, port: int, **extra: str) -> None:
    connection = {"conn_type": "spark", "host": host, "port": port, "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(connection))


def test_without_spark_default_doctor_says_runs_use_the_embedded_master(monkeypatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    finding = doctor._spark_connection()
    assert (
        finding.ok and "'spark_default' is not defined: runs use the embedded local master" in finding.detail
    )


def test_a_standalone_master_and_its_web_ui_are_asked(monkeypatch) -> None:
    alive = {"state": "ALIVE", "cores": 4, "coresfree": 3}
    with standalone_master([alive, alive | {"state": "DEAD"}]) as (port, ui):
        spark_default(monkeypatch, "spark://127.0.0.1", port, **{"master-web-ui": ui})
        finding = doctor._spark_connection()
    assert finding.ok, finding.detail
    assert finding.detail == (
        f"'spark_default': standalone master spark://127.0.0.1:{port} answers; web UI {ui}: ALIVE, "
        "1 alive worker(s), 4 core(s), 3 free"
    )


def test_a_master_that_does_not_answer_is_a_problem(monkeypatch, capsys) -> None:
    port = closed_port()
    spark_default(monkeypatch, "spark://127.0.0.1", port)
    finding = doctor._spark_connection()
    assert not finding.ok
    assert f"standalone master spark://127.0.0.1:{port} does not answer on 127.0.0.1:{port}" in finding.detail
    assert "start the master, or fix the connection's host and port" in finding.detail
    assert doctor.main() == 1 and "MISSING Spark connection:" in capsys.readouterr().out


def test_a_web_ui_extra_that_does_not_answer_and_a_master_without_workers_are_problems(monkeypatch) -> None:
    with standalone_master([]) as (port, ui):
        spark_default(
            monkeypatch, "spark://127.0.0.1", port, **{"master-web-ui": f"http://127.0.0.1:{closed_port()}"}
        )
        finding = doctor._spark_connection()
        assert not finding.ok and "its web UI http://127.0.0.1:" in finding.detail
        assert "runs check the cluster's slots there before submitting" in finding.detail
        spark_default(monkeypatch, "spark://127.0.0.1", port, **{"master-web-ui": ui})
        finding = doctor._spark_connection()
        assert not finding.ok and "no worker has registered" in finding.detail


def test_a_local_master_connection_is_named(monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[4]"}))
    finding = doctor._spark_connection()
    assert finding.ok and finding.detail == "'spark_default': local[4], a local master on this machine."
