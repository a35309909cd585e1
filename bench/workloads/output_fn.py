"""Output workload: rank 0 builds a state_dict of ``mb`` MiB and returns it, or torch.saves it.

Each rank writes its pid to ``stamp_dir/rank<N>.pid`` (for RSS sampling); rank 0 writes
``time.time()`` to ``stamp_dir/t_return`` just before it returns.
"""

from __future__ import annotations

import os
import time
from typing import Any

LAYERS = 10


def big_state_dict(mb: int, stamp_dir: str, save_path: str | None = None) -> Any:
    """Rank 0: ``LAYERS`` float32 tensors totalling ``mb`` MiB, returned (or saved to ``save_path``)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(stamp_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    result: Any = None
    if rank == 0:
        per_layer = max(1, mb * 2**20 // 4 // LAYERS)
        state = {f"layer{i}.weight": torch.randn(per_layer) for i in range(LAYERS)}
        if save_path:
            start = time.time()
            torch.save(state, save_path)
            result = {"t_before_save": start, "t_saved": time.time()}
        else:
            result = state
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(stamp_dir, "t_return"), "w") as f:
            f.write(repr(time.time()))
    return result
