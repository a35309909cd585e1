"""The trivial distributed workload every launch benchmark runs: gloo DDP on a tiny model.

As a script (``torchrun --standalone --nproc_per_node=2 ddp_trivial.py``) it runs :func:`train`;
the other launchers import :func:`train` and ship it as a callable.
"""

from __future__ import annotations

import os
import time
from typing import Any


def train(steps: int = 3) -> dict[str, Any]:
    """init_process_group, one allreduce, a few DDP steps on a 4x1 linear model, destroy.

    Returns rank 0's view: world size, the allreduced sum and the rank's wall-clock start/end
    (``time.time()``), which the profile uses to place the ranks on the launch timeline.
    """
    started = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    joined = time.time()
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
    result = {
        "world_size": dist.get_world_size(),
        "allreduce": total.item(),
        "pid": os.getpid(),
        "t_start": started,
        "t_joined": joined,
        "t_end": time.time(),
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    train()
