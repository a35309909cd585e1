"""Failure workload: rank 1 records ``time.time()`` to a file and raises; rank 0 blocks in a barrier.

The time file's path comes in as an argument, so the benchmark can read when the rank raised.
"""

from __future__ import annotations

import time


def fail_rank_one(stamp_file: str, delay: float = 0.5) -> None:
    """Join the group; rank 1 raises after ``delay`` s while rank 0 waits in ``dist.barrier()``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(delay)
        with open(stamp_file, "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank one refuses to train")
    dist.barrier()  # never completes: rank 1 is gone
