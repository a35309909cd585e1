"""The driver's end of a run: the outcome written and said once (before its SparkContext stops)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from airflow_provider_torchdist.spark.driver.finish import finish, finished_code
from airflow_provider_torchdist.spark.wire.outcome import Outcome


def test_an_outcome_is_written_and_said_once_and_its_code_kept(tmp_path, capsys) -> None:
    assert finished_code(tmp_path) is None
    assert finish(Outcome(ok=True), tmp_path) == 0
    # Spark failing to stop afterwards does not change what the owner may have concluded already.
    assert finish(Outcome(ok=False, error="RuntimeError: stopping Spark failed"), tmp_path) == 0
    assert finished_code(tmp_path) == 0
    assert Outcome.read(tmp_path).ok
    assert capsys.readouterr().out.count("[torchdist] training finished on all ranks") == 1


def test_exit_without_teardown_flushes_what_was_written_and_skips_atexit(tmp_path) -> None:
    """Buffered stdout and a logging handler's buffered lines are out before the process ends with
    its code; what would run at interpreter teardown (atexit) does not."""
    log_file = tmp_path / "driver.log"
    program = textwrap.dedent(
        f"""
        import atexit, logging, sys
        from airflow_provider_torchdist.spark.driver.finish import exit_without_teardown
        handler = logging.StreamHandler(open({str(log_file)!r}, "w", buffering=64 * 1024))
        logging.getLogger("t").addHandler(handler)
        logging.getLogger("t").warning("a rank's last line")
        atexit.register(lambda: print("teardown ran"))
        sys.stdout = open(sys.stdout.fileno(), "w", buffering=64 * 1024, closefd=False)
        print("training finished")
        exit_without_teardown(7)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "training finished\n"
    assert log_file.read_text() == "a rank's last line\n"
