"""The trivial distributed workload every launch benchmark runs: gloo DDP on a tiny model.

As a script (``torchrun --standalone --nproc_per_node=2 ddp_trivial.py``) it runs :func:`train`;
the other launchers import :func:`train` and ship it as a callable.
"""

from __future__ import annotations

import os
import time
from typing import Any


def train(steps: int = 3) -> dict[str, Any]:
    """init_process_group, :func:`work`, destroy.

    Returns rank 0's view: world size, the allreduced sum and the rank's wall-clock start/end
    (``time.time()``), which the profile uses to place the ranks on the launch timeline.
    """
    started = time.time()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = work(steps, started=started, joined=time.time())
    dist.destroy_process_group()
    return result


def work(steps: int = 3, started: float | None = None, joined: float | None = None) -> dict[str, Any]:
    """In a process group made already (by :func:`train`, or by a launcher that makes it itself):
    one allreduce and a few DDP steps on a 4x1 linear model."""
    now = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {
        "world_size": dist.get_world_size(),
        "allreduce": total.item(),
        "pid": os.getpid(),
        "t_start": now if started is None else started,
        "t_joined": now if joined is None else joined,
        "t_end": time.time(),
    }


if __name__ == "__main__":
    train()
