"""The group keeper (spark/node/group_keeper.py) against the deadlock it guards against: a DDP
training that destroys its process group and returns, three times over in each of 2 forked gloo
ranks, as a rank's work does. Without the keeper this torch hangs in the first return (gloo's
destructor joins a worker thread that waits for the GIL the freeing ``Reducer`` holds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from airflow_provider_torchdist.spark.node import group_keeper

RANKS = """
import datetime, os, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from airflow_provider_torchdist.spark.node import group_keeper

def train(r, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    time.sleep(4 * group_keeper.LOOK_EVERY_S)  # a training lasts longer than the keeper's look
    for _ in range(5):
        loss = ddp(torch.rand(4, 3)).sum()
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    dist.destroy_process_group()  # right after the last collective: where the race is
    return "trained"  # the frame with the DDP model goes here

def rank(r, ports, out):
    stop = group_keeper.start()
    outcomes = [train(r, port) for port in ports]
    stop()
    out.put((r, outcomes))

if __name__ == "__main__":
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1])
    queue = mp.get_context("fork").SimpleQueue()
    mp.start_processes(rank, args=(ports, queue), nprocs=2, start_method="fork")
    for r, outcomes in sorted(queue.get() for _ in range(2)):
        print(r, outcomes)
"""


def test_ddp_ranks_that_destroy_their_group_and_return_never_hang(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired as hung:
        os.killpg(proc.pid, signal.SIGKILL)  # the forked ranks too
        proc.communicate()
        raise AssertionError(
            "a rank hung at the end of its training: the group keeper did not keep its group"
        ) from hung
    assert proc.returncode == 0, err[-2000:]
    assert out.splitlines() == ["0 ['trained', 'trained', 'trained']", "1 ['trained', 'trained', 'trained']"]


def test_the_keeper_keeps_nothing_without_a_group() -> None:
    assert group_keeper.keep_default_group() is False
