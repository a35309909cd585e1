"""Run as ``-m torchdist_modtest.train --out DIR [args...]`` on every rank: joins the process group
and writes ``DIR/rank-<rank>`` holding its argv (after the module) and the world size."""

import sys
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / f"rank-{dist.get_rank()}").write_text(" ".join(sys.argv[1:]) + f"|{dist.get_world_size()}|{__name__}")
# Not without a collective first: init_process_group has no barrier of its own, so a rank that
# leaves at once can close its gloo connection while a slower peer is still making it.
dist.barrier()
dist.destroy_process_group()
