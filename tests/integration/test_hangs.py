"""Hung runs, for real (docs/hangs.md): a rank asleep in user code, a mismatched collective and a
frozen (SIGSTOPped) rank are found within hang_timeout, named with their stacks, and stopped; a
healthy run whose steps are slow is never flagged. ``hook.run`` on the embedded master, local mode
except for one distributed case, with the shortest ``hang_timeout`` allowed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import TrainingHung
from tests.integration.run_processes import alive

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

HANG_TIMEOUT = 10
#: From the fault to the task's failure: hang_timeout, then up to 30 s (the issue's bound).
BOUND_S = HANG_TIMEOUT + 30
#: The line rank 1 sleeps on, as the error must name it.
SLEEP_LINE = next(
    n
    for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
    if text.strip() == "time.sleep(3600)  # rank 1 sleeps here"
)


def train_with_fault(fault: str, markers: str, steps: int = 8, step_s: float = 0.05) -> str:
    """A tiny gloo loop; at step 5 the fault (``sleep``, ``mismatch``, ``freeze``; ``none``: healthy)
    strikes. Each rank leaves its own and its agent's PIDs, and the fault's time, in ``markers``."""
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    Path(markers, f"pids{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    for step in range(steps):
        if step == 5 and fault != "none":
            Path(markers, f"fault{rank}").write_text(str(time.time()))
            if fault == "sleep" and rank == 1:
                time.sleep(3600)  # rank 1 sleeps here
            if fault == "freeze" and rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "mismatch":
                tensor = torch.ones(4)
                dist.all_reduce(tensor) if rank == 0 else dist.broadcast(tensor, src=0)
        dist.all_reduce(torch.ones(1))
        time.sleep(step_s)
    dist.destroy_process_group()
    return "done"


def _fail_hung(
    markers: Path, fault: str, capfd: pytest.CaptureFixture[str], local_mode: bool = True
) -> tuple[TrainingHung, str, float]:
    """Run with ``fault``; the TrainingHung, the task log's text and when the fault struck."""
    hook = TorchDistributorHook(
        num_processes=2, local_mode=local_mode, hang_timeout=HANG_TIMEOUT, checkpoint_dir=str(markers)
    )
    with pytest.raises(TrainingHung) as info:
        hook.run(train_with_fault, fault, str(markers))
    failed_at = time.time()
    struck = min(float(p.read_text()) for p in markers.glob("fault*"))
    assert failed_at - struck < BOUND_S, f"{failed_at - struck:.0f} s from the fault to the failure"
    _nothing_left(markers)
    return info.value, "".join(capfd.readouterr()), struck


def _nothing_left(markers: Path) -> None:
    """Every rank and the local driver (a rank's parent, torchrun's agent) gone within 15 s, by PID."""
    pids = {int(pid): "run process" for p in markers.glob("pids*") for pid in p.read_text().split()}
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), f"left running: {alive(pids)}"


@pytest.mark.parametrize(
    "local_mode", [pytest.param(True, id="local_mode"), pytest.param(False, id="distributed")]
)
def test_a_rank_asleep_in_user_code_is_named_with_its_line_and_the_run_stopped(local_mode, tmp_path, capfd):
    error, log, _ = _fail_hung(tmp_path, "sleep", capfd, local_mode)
    message = str(error)
    assert message.startswith("Distributed training failed: training hung: no progress from rank(s)")
    assert (
        "suspect: rank 1 on 127.0.0.1 (not in a collective, or silent, while rank(s) [0] wait in one)"
        in message
    )
    assert f"rank 1 at {__file__}:{SLEEP_LINE} in train_with_fault" in message
    # Both ranks' stacks, one line each on where they are, and the stop.
    assert "stacks of [rank 0 @ 127.0.0.1]:" in log and "stacks of [rank 1 @ 127.0.0.1]:" in log
    assert "time.sleep(3600)  # rank 1 sleeps here" in log
    assert "dist.all_reduce(torch.ones(1))" in log
    assert "hang: [rank 0 @ 127.0.0.1] waits in a collective (torch.distributed all_reduce)" in log
    assert f"hang: [rank 1 @ 127.0.0.1] is not in a collective: at {__file__}:{SLEEP_LINE}" in log
    assert "the stop request (hung) goes to 2 rank(s)" in log


def test_a_mismatched_collective_is_named_by_what_each_rank_waits_in(tmp_path, capfd):
    error, log, _ = _fail_hung(tmp_path, "mismatch", capfd)
    assert "every rank waits in a collective (rank 0 in all_reduce, rank 1 in broadcast)" in str(error)
    assert "hang: [rank 1 @ 127.0.0.1] waits in a collective (torch.distributed broadcast)" in log


def test_a_frozen_rank_is_named_silent_and_killed(tmp_path, capfd):
    error, log, _ = _fail_hung(tmp_path, "freeze", capfd)
    assert "suspect: rank 1 on 127.0.0.1" in str(error) and "rank 1: silent" in str(error)
    assert "hang: [rank 1 @ 127.0.0.1] is silent: nothing from it for" in log
    assert "stacks of [rank 1 @ 127.0.0.1]" not in log  # a frozen rank's threads cannot answer


def test_a_healthy_run_with_slow_steps_beside_a_cpu_hog_is_never_flagged(tmp_path, capfd):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        hook = TorchDistributorHook(num_processes=2, local_mode=True, hang_timeout=HANG_TIMEOUT)
        # Four steps, each blocked in one call for hang_timeout/3: longer than hang_timeout in all.
        assert hook.run(train_with_fault, "none", str(tmp_path), 4, HANG_TIMEOUT / 3) == "done"
    finally:
        hog.kill()
        hog.wait()
    log = "".join(capfd.readouterr())
    assert "training finished on all ranks" in log
    assert "looks hung" not in log and "] hang: " not in log and "stacks of" not in log, log
    assert "straggler:" not in log, log


def train_with_a_straggler(seconds: float, work_s: float = 0.05, slower: float = 3.0) -> dict:
    """A gloo loop whose step is ``work_s`` of computing (a spin: the main thread busy in user code)
    then an all_reduce, rank 1's ``slower`` times longer, for ``seconds``; one report() a step."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import report

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spin = work_s * (slower if rank == 1 else 1.0)
    started, step = time.monotonic(), 0
    flag = torch.ones(1)
    while flag.item() > 0:
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            pass
        # Rank 0 decides when to stop, so every rank runs the same number of collectives.
        flag = torch.tensor([1.0 if rank != 0 or time.monotonic() - started < seconds else 0.0])
        dist.broadcast(flag, src=0)
        dist.all_reduce(torch.ones(1))
        report(step=step)
        step += 1
    dist.destroy_process_group()
    return {"steps": step}


def test_a_rank_slowed_three_times_is_named_as_a_straggler_and_the_run_succeeds(capfd):
    from airflow_provider_torchdist.spark.driver.stragglers import SUSTAIN_S, WINDOW_S

    hook = TorchDistributorHook(num_processes=2, local_mode=True, hang_timeout=HANG_TIMEOUT)
    assert hook.run(train_with_a_straggler, SUSTAIN_S + WINDOW_S / 2 + 10)["steps"] > 20
    log = "".join(capfd.readouterr())
    named = [line for line in log.splitlines() if "straggler:" in line]
    assert len(named) == 1, named  # once, and only rank 1
    assert "straggler: [rank 1 @ 127.0.0.1] has run" in named[0] and "slower than the other ranks" in named[0]
    factor = float(named[0].split("has run ")[1].split("x slower")[0])
    assert factor >= 2.0, named[0]  # compute time a step, by sampling: about 3 on a quiet machine
    # Each rank's mean step time (equal: they step together) and compute share, apart from the reports.
    summary = {m["rank"]: m for m in hook.rank_step_times}
    assert sorted(summary) == [0, 1], hook.rank_step_times
    assert all("step" in m for m in hook.metrics)  # the reports alone
    assert summary[1]["compute_share"] > 0.8 > 0.6 > summary[0]["compute_share"], summary
    assert abs(summary[0]["mean_step_time_s"] - summary[1]["mean_step_time_s"]) < 0.05, summary
