"""Steady-state training throughput workload: a few-layer MLP on synthetic data, gloo DDP.

As a script (``torchrun --standalone --nproc_per_node=2 mlp_train.py``) rank 0 prints a
``RESULT {json}`` line; the hook benchmarks ship :func:`train_mlp` as a callable.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def train_mlp(
    steps: int = 60,
    windows: int = 5,
    warmup: int = 30,
    batch: int = 128,
    width: int = 256,
    threads: int | None = None,
) -> dict[str, Any]:
    """Time ``windows`` windows of ``steps`` DDP steps after ``warmup`` steps.

    Returns rank 0's median and best window rate (steps/s), the slowest rank's median, and the
    thread settings the rank saw. The median of several windows damps a busy machine's noise.
    ``threads`` calls ``torch.set_num_threads`` first (what a launcher could do for its ranks).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(256, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    rates = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps / (time.perf_counter() - start))
    rates.sort()
    rate = torch.tensor([rates[len(rates) // 2]])
    slowest = rate.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    result = {
        "steps_per_s": rate.item(),
        "best_window_steps_per_s": rates[-1],
        "slowest_rank_steps_per_s": slowest.item(),
        "world_size": dist.get_world_size(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "torch_num_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    value = train_mlp()
    if os.environ.get("RANK") == "0":
        print("RESULT " + json.dumps(value), flush=True)
