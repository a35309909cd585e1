"""What a rank sets up: OutputCapture, and the size of its torch thread pool.

OutputCapture sends everything a rank writes to fds 1 and 2 to the driver as separate lines. It
dup2s fds 1 and 2, so it runs in a child Python process; the RunChannel it reports to runs here,
in the test process.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

from airflow_provider_torchdist.spark.driver.channel import RunChannel
from airflow_provider_torchdist.spark.node.rank import apply_thread_count, rank_thread_count
from tests.unit.conftest import fast_shutdown

TOKEN = "capture-token"
#: The node's host as the driver registered it: this machine, so the rank's peer check passes.
HOST = "localhost"
PREFIX = "[rank 1 @ localhost]"

CHILD_HEADER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
    from airflow_provider_torchdist.spark.node.output_capture import OutputCapture

    host, port, token, node_key = sys.argv[1], int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4])
    client = (
        ChannelClient.as_rank(
            (host, port), token, node=0, rank=1, generation=0, host="localhost", node_key=node_key
        )
        if port
        else None
    )
    capture = OutputCapture(client, "[rank 1 @ localhost]")
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
    channel = fast_shutdown(
        RunChannel(TOKEN, "127.0.0.1", tmp_path, out=out, ranks_of_node=lambda n: range(2))
    )
    with channel:
        node = channel.registry.add_local(0, HOST)  # node 0 runs ranks 0 and 1; the child is rank 1
        host, port = channel.address
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD_HEADER + textwrap.dedent(body) + CHILD_FOOTER,
                host,
                str(port if connect else 0),
                TOKEN,
                node.key.hex(),
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
    assert stderr[1] == "[rank 1 @ localhost] hello"
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


# -- torch threads per rank ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nproc", "preset", "task_cpus", "cpus_allowed", "expected"),
    [
        (2, None, None, 2, "1"),  # local mode, several ranks: torchrun's 1
        (1, None, None, 8, None),  # one rank: torch's own default
        (4, "3", None, 8, None),  # the user's value is kept
        (2, "2", 2, 2, "1"),  # Spark's OMP_NUM_THREADS=spark.task.cpus, split between 2 ranks
        (4, "8", 8, 8, "2"),
        (1, "4", 4, 4, "4"),
        (4, "8", 8, 2, "1"),  # a cpuset of 2 CPUs for 4 ranks: never more than the CPUs allow
        (2, "8", 8, 4, "2"),
        (2, "6", 4, 4, None),  # spark.executorEnv.OMP_NUM_THREADS=6: the user's, kept
    ],
)
def test_rank_thread_count(nproc, preset, task_cpus, cpus_allowed, expected):
    environ = {} if preset is None else {"OMP_NUM_THREADS": preset}
    assert (
        rank_thread_count(nproc, environ=environ, task_cpus=task_cpus, cpus_allowed=cpus_allowed) == expected
    )


def test_forked_rank_sizes_torch_threads_from_its_environment():
    """A rank forked from an agent whose torch pool was sized first gets its own OMP_NUM_THREADS."""
    child = textwrap.dedent(
        """
        import os, torch
        from airflow_provider_torchdist.spark.node.rank import apply_thread_count

        torch.set_num_threads(3)  # the agent's pool, sized before the ranks' value was set
        os.environ["OMP_NUM_THREADS"] = "1"
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # like torchrun's start_method="fork"
            applied = apply_thread_count()
            os.write(write_end, f"{applied} {torch.get_num_threads()}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(read_end, 100).decode(), torch.get_num_threads())
        """
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "3"]  # the rank: applied 1, has 1; the agent keeps 3


@pytest.mark.parametrize("value", ["", "0", "two"])
def test_unusable_omp_num_threads_changes_nothing(value):
    assert apply_thread_count({"OMP_NUM_THREADS": value}) is None
