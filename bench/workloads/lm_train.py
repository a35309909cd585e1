"""The steady-state workload: a small causal transformer language model on synthetic tokens.

Each rank trains the same model (2 layers, width 128, 4 heads, a 4,096-token vocabulary,
sequences of :data:`SEQ` tokens) with DDP over gloo on its own shard of the token set, for a fixed
number of steps, and reports what a user of a long run cares about: tokens per second once
training is going (after :data:`WARMUP_STEPS`) and when the first step ended.

Two ways in, the same training:

- raw torchrun: ``torchrun --standalone --nproc_per_node=2 lm_train.py --data DIR --steps N``;
  each rank reads its half of the Parquet files in ``DIR`` itself (pyarrow, local files);
- this project: :func:`train_from_shard` as the callable, the rows dealt to the ranks by
  ``train_data`` and read with ``rank_batches`` (``lm_hook.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from typing import Any

VOCAB = 4096
SEQ = 128
WARMUP_STEPS = 10


def _model() -> Any:
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 128)
            self.position = torch.nn.Parameter(torch.zeros(SEQ, 128))
            layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, 2)
            self.head = torch.nn.Linear(128, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            n = tokens.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
            hidden = self.blocks(self.embed(tokens) + self.position[:n], mask=mask, is_causal=True)
            return self.head(hidden)

    return TinyLM()


def train(batches: Iterator[Any], steps: int) -> dict[str, Any]:
    """``steps`` optimizer steps on ``batches`` (int tensors ``(batch, SEQ)``) in the process group
    made already; every rank returns its figures, rank 0's are the run's."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    first_step_at = None
    timed_tokens, timed_from, loss = 0, 0.0, None
    done = 0
    for tokens in batches:
        if done == steps:
            break
        tokens = tokens.long()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += 1
        if first_step_at is None:
            first_step_at = time.time()
        if done == WARMUP_STEPS:
            timed_from = time.perf_counter()
        elif done > WARMUP_STEPS:
            timed_tokens += tokens.shape[0] * (tokens.shape[1] - 1)
    elapsed = time.perf_counter() - timed_from
    world = dist.get_world_size()
    return {
        "world_size": world,
        "steps": done,
        "tokens_per_s": timed_tokens * world / elapsed if done > WARMUP_STEPS else None,
        "first_step_at": first_step_at,
        "loss": None if loss is None else float(loss.item()),
    }


def train_from_shard(steps: int, batch: int) -> dict[str, Any]:
    """This project's entry: the rank's shard of ``train_data``, through ``rank_batches``."""
    import torch.distributed as dist

    from airflow_provider_torchdist import rank_batches

    dist.init_process_group("gloo")
    result = train((b["tokens"] for b in rank_batches(batch, columns=["tokens"], drop_last=True)), steps)
    dist.destroy_process_group()
    return result


def _local_shard(data: str, batch: int) -> Iterator[Any]:
    """Raw torchrun's way: this rank's contiguous half of the Parquet files' rows, read here."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    table = pq.read_table(data, columns=["tokens"])
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = table.num_rows // world
    mine = table.slice(rank * per_rank, per_rank).column("tokens").combine_chunks()
    tokens = np.asarray(mine.flatten().to_numpy()).reshape(-1, SEQ)
    for start in range(0, len(tokens) - batch + 1, batch):
        yield torch.from_numpy(tokens[start : start + batch])


def parse_args(description: str) -> argparse.Namespace:
    """Both entries' arguments: the token set's folder, the steps, the batch size (and the hook's
    ``hang_timeout``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--hang-timeout", type=float, default=None, help="lm_hook.py's only: 0 turns the hang watchdog off"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = train(_local_shard(args.data, args.batch), args.steps)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"value": result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
