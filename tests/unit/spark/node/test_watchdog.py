"""A rank's hang watchdog: where a thread is, whether it moves, its stacks, and the progress events
that ``report()`` and ``stop_requested()`` count (real threads; real ranks: tests/integration/test_hangs.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed.distributed_c10d as c10d

from airflow_provider_torchdist import report, stop_requested
from airflow_provider_torchdist.spark.node import progress, watchdog
from airflow_provider_torchdist.spark.node.watchdog import RankWatchdog, nccl_flight_recorder, position
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress
from tests.unit.conftest import wait_until


@pytest.fixture(autouse=True)
def _users_code_running():
    """As in a rank whose code runs: another test's ``call_work`` may have marked it returned."""
    progress.work_done.clear()
    yield
    progress.work_done.clear()


RANK_PY = os.path.join(os.path.dirname(watchdog.__file__), "rank.py")
ELASTIC = os.path.join(os.path.dirname(c10d.__file__), "elastic", "multiprocessing", "api.py")
USER = "/home/me/dags/train.py"


def test_the_position_is_the_innermost_user_frame_and_the_collective_it_waits_in():
    stack = [
        (ELASTIC, 10, "_wrap"),  # torchrun's own frames under the rank: not a collective
        (RANK_PY, 150, "call_entry"),
        (USER, 12, "train"),
        (c10d.__file__.replace("distributed_c10d", "c10d_logger"), 80, "wrapper"),
        (c10d.__file__, 2500, "all_reduce"),
    ]
    assert position(stack) == (f"{USER}:12 in train", "all_reduce")
    assert position(stack[:3] + [(threading.__file__, 300, "wait")]) == (f"{USER}:12 in train", None)
    # Before the user's code runs (or in torchrun's frames only): no collective, the innermost frame.
    assert position(stack[:1]) == (f"{ELASTIC}:10 in _wrap", None)


def _thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_blocked_thread_never_moves_and_a_working_one_does():
    release = threading.Event()
    blocked = _thread(lambda: release.wait(30))
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():  # two "steps", each blocked in a call: a sample finds one or the other
            time.sleep(0.003)
            time.sleep(0.004)

    working = _thread(work)
    try:
        still, busy = (
            RankWatchdog(lambda m: True, main=blocked.ident),
            RankWatchdog(lambda m: True, main=working.ident),
        )
        for _ in range(20):
            still.sample()
            busy.sample()
            time.sleep(0.01)
        assert still.moves == 0
        assert busy.moves >= 5
        answer = still.stacks()
        assert answer.text.startswith(f"main thread ({blocked.ident}), most recent call last:")
        assert "release.wait(30)" in answer.text and "thread 'MainThread'" in answer.text
        assert answer.where.startswith(__file__) and answer.waits_in is None
    finally:
        release.set()
        stop.set()


def test_the_watchdog_thread_reports_progress_until_stopped(monkeypatch):
    sent: list[Progress] = []
    dog = RankWatchdog(lambda m: sent.append(m) is None, sample_every=0.01, report_every=0.05)
    dog.start()
    wait_until(lambda: len(sent) >= 3, what="three progress messages")
    text = dog.stacks().text  # the watchdog's own thread is counted, not printed: it is not the user's
    assert "'torchdist-watchdog'" not in text and "more thread(s) of the provider's own" in text
    while_waiting = list(sent)
    dog.stop()
    assert all(m.pid == os.getpid() for m in sent)
    assert while_waiting[-1].where.endswith("in wait_until")  # the main thread waits in the conftest helper
    # Stopping sends the final counts at once, from where the main thread stops it.
    assert len(sent) == len(while_waiting) + 1 or sent[-2].where.endswith("in wait_until")
    assert sent[-1].where.endswith("in test_the_watchdog_thread_reports_progress_until_stopped")
    dog.stop()
    assert sent[-1].where.endswith("until_stopped") and len(sent) <= len(while_waiting) + 2  # once


def test_the_watchdog_thread_ends_when_the_channel_breaks():
    dog = RankWatchdog(lambda m: False, sample_every=0.01, report_every=0.01)
    dog.start()
    dog._thread.join(5)
    assert not dog._thread.is_alive()


def test_report_and_stop_requested_count_as_progress_on_every_rank(monkeypatch, capsys):
    before, _ = progress.take()
    monkeypatch.setenv("RANK", "3")  # not rank 0: report() sends nothing, but it still counts
    report(step=1, loss=1.0)
    time.sleep(0.01)
    stop_requested()
    events, gap = progress.take()
    assert events == before + 2
    assert gap is not None and gap >= 0.01
    assert progress.take()[1] is None  # the gaps are taken once


def test_nccl_flight_recorder_only_for_gpu_runs_with_the_watchdog_and_never_over_the_clusters(monkeypatch):
    assert nccl_flight_recorder(False, 300.0) == {} and nccl_flight_recorder(True, None) == {}
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")
    env = nccl_flight_recorder(True, 300.0)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    trace_dir = os.path.dirname(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
    assert os.stat(trace_dir).st_mode & 0o777 == 0o700
    os.rmdir(trace_dir)


def test_once_the_users_code_returned_a_still_rank_is_handing_over_not_hung():
    release = threading.Event()
    blocked = _thread(lambda: release.wait(30))  # sending rank 0's output, say: one long call
    dog = RankWatchdog(lambda m: True, main=blocked.ident)
    try:
        progress.work_done.set()
        for _ in range(3):
            dog.sample()
        assert dog.moves == 3
    finally:
        progress.work_done.clear()
        release.set()


def test_the_collectives_a_rank_issued_are_counted_from_its_process_group(tmp_path):
    """In a process of its own (a real gloo group of one): none before the group, then one per collective."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist\n"
        "from airflow_provider_torchdist.spark.node.watchdog import collectives_issued\n"
        "before = collectives_issued()\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='file://"
        + str(tmp_path / "store")
        + "')\n"
        "first = collectives_issued()\n"
        "dist.all_reduce(torch.ones(1)); dist.barrier()\n"
        "print(before, first, collectives_issued())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    before, first, after = out.stdout.split()
    assert before == "None" and int(after) == int(first) + 2


SHIPPED = """
import sys
sys.path.insert(0, "./torchdist_spark.zip")  # as spark-submit's --py-files puts it: a relative path
from airflow_provider_torchdist.spark.node import watchdog
rank_py = watchdog.__file__.replace("watchdog.py", "rank.py")
assert rank_py.startswith("./torchdist_spark.zip/"), rank_py
launcher = sys.argv[1]
stack = [
    (launcher, 374, "launch_agent"),  # a rank forked from torchrun's agent has the agent's frames
    (rank_py, 139, "call_entry"),
    ("/dags/train.py", 9, "train"),
]
print(watchdog.position(stack))
"""


def test_a_rank_of_the_shipped_zip_forked_from_torchruns_agent_is_not_in_its_agents_call(tmp_path):
    """Hunt (elastic hang test): on a cluster the package is imported from ``./torchdist_spark.zip``,
    so its code objects name relative paths; the agent's ``launch_agent`` frames under a forked rank
    were taken for a collective it waits in, and a rank asleep in user code was no suspect."""
    import subprocess
    import sys

    from airflow_provider_torchdist.submit.staging import _spark_zip

    _spark_zip(tmp_path / "torchdist_spark.zip")
    launcher = os.path.join(os.path.dirname(c10d.__file__), "launcher", "api.py")
    out = subprocess.run(
        [sys.executable, "-c", SHIPPED, launcher], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "('/dags/train.py:9 in train', None)"


def test_the_installed_torch_has_the_flight_recorder_dump_the_watchdog_calls() -> None:
    """The dump on a hang goes through a private torch call whose name changed (torch 2.8 renamed
    ``_dump_nccl_trace`` to ``_dump_fr_trace``): the one installed must have one of them, or GPU
    hangs would quietly come without their NCCL trace. (The dump itself needs NCCL: a lent GPU.)"""
    import torch._C._distributed_c10d as c10d

    assert callable(getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None))
