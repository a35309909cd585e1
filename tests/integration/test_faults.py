"""Faults, for real: ranks killed by signals, restarts that resume from checkpoints, kills from Airflow."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorHook, load_latest_checkpoint, save_checkpoint
from airflow_provider_torchdist.errors import TrainingFailed
from airflow_provider_torchdist.supervision.processes import is_alive

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

MODES = [pytest.param(True, id="local_mode"), pytest.param(False, id="distributed")]


def train_with_checkpoints(steps: int, every: int, die_at: int) -> dict:
    """Ten steps of a tiny DDP model; checkpoints every ``every`` steps; rank 1 is SIGKILLed once."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import checkpoint_dir

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    start, state = load_latest_checkpoint() or (0, None)
    if state:
        model.module.load_state_dict(state["model"])
    marker = checkpoint_dir() / "killed-once"
    done = []
    for step in range(start, steps):
        if step == die_at and dist.get_rank() == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, say
        model(torch.ones(4, 2)).sum().backward()
        dist.barrier()
        done.append(step)
        if (step + 1) % every == 0:
            save_checkpoint({"model": model.module.state_dict()}, step + 1)
    dist.destroy_process_group()
    return {
        "resumed_from": start,
        "steps_run": done,
        "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    }


def test_rank_killed_once_resumes_after_restart_from_latest_checkpoint(tmp_path: Path) -> None:
    hook = TorchDistributorHook(
        num_processes=2, local_mode=True, max_restarts=1, checkpoint_dir=str(tmp_path)
    )
    result = hook.run(train_with_checkpoints, 10, 2, 5)

    assert result["restarts"] == 1
    assert result["resumed_from"] == 4  # the newest checkpoint: at most one interval (2 steps) lost
    assert result["steps_run"] == list(range(4, 10))  # it reached the target step count
    assert (tmp_path / "killed-once").exists()


@pytest.mark.parametrize("local_mode", MODES)
def test_rank_killed_by_signal_fails_run_naming_rank_host_and_signal(
    local_mode: bool, tmp_path: Path
) -> None:
    with pytest.raises(TrainingFailed) as info:
        TorchDistributorHook(num_processes=2, local_mode=local_mode, checkpoint_dir=str(tmp_path)).run(
            train_with_checkpoints, 10, 2, 1
        )
    # From the kill (rank 1 touches the marker just before it SIGKILLs itself) to the task's failure,
    # spark-submit and every process gone: start-up is not part of it.
    assert time.time() - (tmp_path / "killed-once").stat().st_mtime < 30
    assert info.value.failed_ranks[0] == 1  # the root cause first, before peers that lost it
    message = str(info.value)
    # Either rank 1's agent saw the SIGKILL itself, or (local mode, one agent for both ranks) the agent saw both
    # end at once and the channel, which saw rank 1 vanish first, supplies the cause: both name rank 1 and a signal.
    assert any(
        phrase in message
        for phrase in (
            "rank 1 on 127.0.0.1 failed: killed by SIGKILL",
            "rank 1 on 127.0.0.1 failed: the process died without reporting an error (killed by a signal",
        )
    ), message
    if not local_mode:  # rank 1's own agent always sees how it ended
        assert "rank 1 on 127.0.0.1 failed: killed by SIGKILL" in message


def sleep_forever(marker: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(marker, f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(600)


@pytest.mark.parametrize("local_mode", MODES)
def test_on_kill_ends_every_process_and_removes_staging(local_mode: bool, tmp_path: Path) -> None:
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, staging_dir=str(tmp_path / "staging"))
    os.makedirs(tmp_path / "staging")
    errors: list[BaseException] = []
    runner = threading.Thread(target=lambda: _catch(errors, hook.run, sleep_forever, str(tmp_path)))
    runner.start()
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and runner.is_alive(), f"ranks never started: {errors}"
        time.sleep(0.2)
    rank_pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]

    killed_at = time.monotonic()
    hook.on_kill()  # what Airflow calls when the task is marked failed, cleared or times out
    runner.join(30)

    assert not runner.is_alive()
    assert time.monotonic() - killed_at < 15
    for pid in rank_pids:
        assert not is_alive(pid), f"rank process {pid} survived the kill"
    assert list((tmp_path / "staging").iterdir()) == []  # the staging directory is gone
    assert errors, "a killed run must not look like a success"


def _catch(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        errors.append(exc)


@pytest.mark.parametrize("local_mode", MODES)
def test_a_sigkilled_supervisor_leaves_nothing_of_its_run_running(local_mode: bool, tmp_path: Path) -> None:
    """The supervisor is SIGKILLed while the ranks train (an OOM kill, a lost container): nobody is
    left to end spark-submit's session, so the kernel must: spark-submit gets SIGTERM when the
    supervisor dies, its driver when the JVM goes, the ranks when their agent goes. Nothing of the
    run is left 20 s later, checked by PID."""
    import psutil

    from tests.integration.run_processes import is_supervisor

    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode)
    hook.start_run(sleep_forever, [str(tmp_path)], {}, durable=True, reattach_timeout=300.0)
    hook.detach()  # a durable run without an owner waits for one: only the supervisor's death ends it
    (supervisor,) = [p for p in psutil.Process().children() if is_supervisor(p)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    run = supervisor.children(recursive=True)
    rank_pids = {int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)}
    assert any("SparkSubmit" in " ".join(p.cmdline()) for p in run), [p.cmdline()[:3] for p in run]

    supervisor.kill()
    supervisor.wait(10)
    gone, alive = psutil.wait_procs(run, timeout=20)
    assert not alive, (
        f"left running after the supervisor's SIGKILL: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
    )
    assert not any(is_alive(pid) for pid in rank_pids), "a rank outlived its supervisor"
