"""A training callable that waits at a gate: for benchmarks that act while every rank trains.

Each rank writes its pid to ``<gate_dir>/training-<rank>``, prints ``waiting rank R`` and polls for
``<gate_dir>/release`` every 10 ms; rank 0 then returns its world size.
"""

from __future__ import annotations


def gated(gate_dir: str) -> dict[str, int] | None:
    import os
    import time
    from pathlib import Path

    rank = int(os.environ["RANK"])
    gate = Path(gate_dir)
    print(f"waiting rank {rank}", flush=True)
    (gate / f"training-{rank}").write_text(str(os.getpid()))
    while not (gate / "release").exists():
        time.sleep(0.01)
    return {"world_size": int(os.environ["WORLD_SIZE"])} if rank == 0 else None
