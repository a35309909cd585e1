"""Rank side of ``bench/sharded_checkpoints.py`` (under torchrun, gloo): a sharded state of
``--tensors`` DTensors of ``--tensor-mib`` MiB each (split in rows over the ranks), saved and
restored through the checkpoint store, sync and async interleaved, and by raw DCP as a baseline.

Rank 0 prints one line ``RESULT {json}``: per round and mode, the seconds training was blocked,
the seconds to the commit, and the seconds a restore took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint, wait_for_checkpoints


def make_state(mesh, tensors: int, mib: int, seed: int) -> dict[str, DTensor]:
    rows = mib * 1024 * 1024 // 4 // 1024  # float32 rows of 1024
    local = rows // mesh.size()
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return {
        f"layer{i}.weight": DTensor.from_local(
            torch.randn(local, 1024, generator=generator), mesh, [Shard(0)], run_check=False
        )
        for i in range(tensors)
    }


def zeros_like(state: dict[str, DTensor]) -> dict[str, DTensor]:
    return {
        k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements)
        for k, v in state.items()
    }


def same(a: dict[str, DTensor], b: dict[str, DTensor]) -> bool:
    return all(torch.equal(a[k].to_local(), b[k].to_local()) for k in a)


def one_round(state, round_no: int, mode: str, baseline_dir: str, step: int) -> dict[str, float]:
    dist.barrier()
    started = time.perf_counter()
    if mode == "dcp":
        target = os.path.join(baseline_dir, f"r{round_no}")
        dcp.save(state, checkpoint_id=target)
        blocked = committed = time.perf_counter() - started
        dist.barrier()
        into = zeros_like(state)
        started = time.perf_counter()
        dcp.load(into, checkpoint_id=target)
    else:
        save_checkpoint(state, step, asynchronous=mode == "async")
        blocked = time.perf_counter() - started
        wait_for_checkpoints()
        committed = time.perf_counter() - started
        dist.barrier()
        into = zeros_like(state)
        started = time.perf_counter()
        found = load_latest_checkpoint(state=into)
        assert found and found[0] == step, found
    restored = time.perf_counter() - started
    assert same(state, into), "the restored state differs"
    dist.barrier()
    return {"blocked_s": blocked, "commit_s": committed, "restore_s": restored}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--baseline", action="store_true", help="also raw DCP to a local temp dir")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = make_state(mesh, args.tensors, args.tensor_mib, seed=0)
    modes = ["sync", "async"] + (["dcp"] if args.baseline else [])
    baseline_dir = tempfile.mkdtemp(prefix="bench-dcp-") if dist.get_rank() == 0 else ""
    shared = [baseline_dir]
    dist.broadcast_object_list(shared, src=0)  # the bench's own value, on one machine
    samples: dict[str, list] = {m: [] for m in modes}
    for round_no in range(args.warmup + args.rounds):
        order = modes if round_no % 2 == 0 else modes[::-1]
        for index, mode in enumerate(order):
            step = round_no * 10 + index + 1  # steps only grow: the newest is the one just saved
            sample = one_round(state, round_no, mode, shared[0], step)
            if round_no >= args.warmup:
                samples[mode].append(sample)
    if dist.get_rank() == 0:
        shutil.rmtree(baseline_dir, ignore_errors=True)
        nbytes = sum(v.numel() * v.element_size() for v in state.values())  # the global state
        print(
            "RESULT "
            + json.dumps({"state_bytes": nbytes, "world_size": dist.get_world_size(), "samples": samples}),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
