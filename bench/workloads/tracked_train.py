"""The experiment-tracking benchmark's training function: the throughput benchmark's MLP, with a
``report()`` every step, so that a tracked run has a metric per step to log.

The operator ships :func:`train_tracked` (``bench/dags/bench_tracking.py``); it times its own
steady-state steps (after warm-up steps, launch excluded) and rank 0 writes its result as JSON to
``out``, which ``bench/tracking.py`` reads after the DAG run.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def train_tracked(
    steps: int = 300, windows: int = 5, warmup: int = 30, batch: int = 128, width: int = 256, out: str = ""
) -> dict[str, Any]:
    """Time ``windows`` windows of ``steps`` DDP steps after ``warmup`` steps, reporting the loss at
    every step (the warm-up's too); rank 0's median window rate (steps/s) and the reports it made."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_torchdist import report

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    layers: list[torch.nn.Module] = []
    for n_in in (256, width, width):
        layers += [torch.nn.Linear(n_in, width), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    total = warmup + windows * steps
    done = 0

    def step() -> None:
        nonlocal done
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        report(step=done, total_steps=total, loss=loss.detach())  # rank 0's is kept
        done += 1

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
    result = {
        "steps_per_s": rates[len(rates) // 2],
        "window_steps_per_s": rates,
        "reports": done,
        "world_size": dist.get_world_size(),
        "torch_num_threads": torch.get_num_threads(),
    }
    dist.destroy_process_group()
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(result, f)
    return {"steps_per_s": result["steps_per_s"], "pid": os.getpid()}
