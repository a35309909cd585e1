"""A stand-alone DDP training script, run by torchrun's agent on every rank (``script_training``).

It reads its settings from the command line, like any ``torchrun train_script.py --epochs 5``
script, trains a linear regression over gloo, prints one line per rank and exits 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10, help="full passes over this rank's data")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--samples", type=int, default=64, help="samples per rank")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.samples, 1, generator=generator)
    y = 3 * x + 1 + 0.01 * torch.randn(args.samples, 1, generator=generator)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"script rank {rank}/{world_size} epoch {epoch} loss {loss.item():.5f}", flush=True)
    weight = model.module.weight.item()
    print(f"script rank {rank}/{world_size} done: weight {weight:.4f} loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
