"""OutputCapture: everything a rank writes to fds 1 and 2 reaches the driver as separate lines.

OutputCapture dup2s fds 1 and 2, so it runs in a child Python process; the RunChannel it reports
to runs here, in the test process.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

from airflow_provider_torchdist.spark.channel import RunChannel
from tests.unit.conftest import fast_shutdown

TOKEN = "capture-token"
PREFIX = "[rank 1 @ hostX]"

CHILD_HEADER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from airflow_provider_torchdist.spark.channel import ChannelClient
    from airflow_provider_torchdist.spark.rank import OutputCapture

    host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    client = ChannelClient((host, port), token, 1, "hostX") if port else None
    capture = OutputCapture(client, "[rank 1 @ hostX]")
    capture.start()
    """
)

CHILD_FOOTER = textwrap.dedent(
    """
    capture.stop()
    if client:
        client.close()
    """
)


def _run_child(body: str, tmp_path, *, connect: bool = True) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run ``body`` between capture.start() and capture.stop() in a child; return the channel's lines."""
    out = io.StringIO()
    channel = fast_shutdown(RunChannel(TOKEN, "127.0.0.1", tmp_path, out=out))
    with channel:
        host, port = channel.address
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD_HEADER + textwrap.dedent(body) + CHILD_FOOTER,
                host,
                str(port if connect else 0),
                TOKEN,
            ],
            capture_output=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    return out.getvalue().splitlines(), result


def _texts(lines: list[str]) -> list[str]:
    for line in lines:
        assert line.startswith(PREFIX + " "), line
    return [line.removeprefix(PREFIX + " ") for line in lines]


def test_python_os_write_child_process_and_progress_bars_become_lines(tmp_path):
    body = r"""
    print("from python print")
    os.write(1, b"from os.write\n")
    subprocess.run(["echo", "from a child process"], check=True)
    print("to stderr", file=sys.stderr)
    sys.stdout.write("10%\r20%\r30%\n")
    sys.stdout.flush()
    os.write(1, b"split crlf\r")
    time.sleep(0.2)
    os.write(1, b"\nafter the split\n")
    os.write(1, b"caf\xc3")
    time.sleep(0.2)
    os.write(1, b"\xa9 split utf-8\n")
    os.write(1, b"a" * 200000 + b"\n")
    os.write(1, b"no newline at the end")
    """
    lines, result = _run_child(body, tmp_path)
    texts = _texts(lines)
    assert result.stdout == b""  # nothing escaped the capture
    assert texts.count("to stderr") == 1
    stdout_texts = [t for t in texts if t != "to stderr"]
    assert stdout_texts == [
        "from python print",
        "from os.write",
        "from a child process",
        "10%",
        "20%",
        "30%",
        "split crlf",
        "after the split",
        "café split utf-8",
        "a" * 200000,
        "no newline at the end",
    ]
    assert "" not in texts  # the \r\n split across writes made no blank line


def test_stderr_lines_are_captured_from_c_level_writes(tmp_path):
    body = r"""
    os.write(2, b"first\r\nsecond\n")
    """
    lines, _ = _run_child(body, tmp_path)
    assert _texts(lines) == ["first", "second"]


def test_without_a_channel_lines_fall_back_to_the_original_stderr(tmp_path):
    body = r"""
    print("hello")
    """
    lines, result = _run_child(body, tmp_path, connect=False)
    assert lines == []
    stderr = result.stderr.decode().splitlines()
    assert stderr[0].startswith("[torchdist] log channel to the driver is down (not connected)")
    assert stderr[1] == "[rank 1 @ hostX] hello"
    assert result.stdout == b""


def test_fds_are_restored_after_stop(tmp_path):
    body = r"""
    print("captured")
    capture.stop()
    print("after stop goes to the real stdout")
    capture.start()
    """
    lines, result = _run_child(body, tmp_path)
    assert _texts(lines) == ["captured"]
    assert result.stdout.decode().splitlines() == ["after stop goes to the real stdout"]


def test_repeated_identical_lines_are_all_forwarded(tmp_path):
    body = r"""
    print("epoch done: loss=0.5")
    print("epoch done: loss=0.5")
    """
    lines, _ = _run_child(body, tmp_path)
    assert _texts(lines) == ["epoch done: loss=0.5", "epoch done: loss=0.5"]
