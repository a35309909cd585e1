"""Sharded checkpoints: the time training is blocked per checkpoint, sync against async, and save
and restore throughput, on local disk and on an object store.

Usage: ``python bench/sharded_checkpoints.py [--rounds 3] [--warmup 1] [--tensors 16] [--tensor-mib 64]``

The state: ``--tensors`` float32 ``DTensor``s of ``--tensor-mib`` MiB each (16 of 64 MiB: 1 GiB in
all), sharded by rows over 2 ranks (torchrun, gloo, one machine), as FSDP2 shards parameters.
``bench/workloads/sharded_ckpt.py`` runs in the ranks; per round, interleaved (order alternating by
round, after ``--warmup`` uncounted rounds):

- **sync**: ``save_checkpoint(state, step)``: blocked until committed;
- **async**: ``save_checkpoint(state, step, asynchronous=True)``: blocked while the state is
  copied, then ``wait_for_checkpoints()`` until it is committed;
- **dcp** (local disk only): raw ``torch.distributed.checkpoint.save`` / ``load`` to a temp dir,
  the baseline: no manifest, no hashes, no retention, no checks before the load.

After each save, every rank restores it into a zeroed state of the same placements
(``load_latest_checkpoint(state=...)``) and checks it equals what was saved. Stores: a local temp
dir, and moto's S3 server in a process of its own (started and stopped by PID), reached by s3fs
over HTTP. Results (medians; async blocked / sync blocked; GB/s = 10^9 bytes a second of the
global state) go to the ``sharded_checkpoints`` section of ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests' S3 server

from common import BIN, WORKLOADS, loadavg, log, machine_info, median, update_results  # noqa: E402

from tests.object_store import start_s3_server, stop_s3_server  # noqa: E402

GB = 1e9


def run_ranks(env: dict[str, str], args: argparse.Namespace, baseline: bool) -> dict[str, Any]:
    """The ranks' samples for one store (one torchrun of 2 ranks)."""
    command = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "2",
        str(WORKLOADS / "sharded_ckpt.py"),
        f"--tensors={args.tensors}",
        f"--tensor-mib={args.tensor_mib}",
        f"--rounds={args.rounds}",
        f"--warmup={args.warmup}",
        *(["--baseline"] if baseline else []),
    ]
    proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(
            f"the ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(line.removeprefix("RESULT "))


def stats(samples: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """Medians of one store's and mode's rounds."""
    blocked, commit, restore = (
        median([s[k] for s in samples]) for k in ("blocked_s", "commit_s", "restore_s")
    )
    return {
        "n": len(samples),
        "median_blocked_s": blocked,
        "median_commit_s": commit,
        "median_restore_s": restore,
        "save_gb_s": nbytes / commit / GB,
        "restore_gb_s": nbytes / restore / GB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    proc, server = start_s3_server(work / "moto.log")
    try:
        bucket = server.bucket()
        stores = {
            "local": {"TORCHDIST_CHECKPOINT_DIR": str(work / "local")},
            "s3": {
                "TORCHDIST_CHECKPOINT_DIR": f"s3://{bucket}/sharded",
                "TORCHDIST_CHECKPOINT_STORAGE_OPTIONS": json.dumps(server.storage_options),
            },
        }
        loads, results = [loadavg()[0]], {}
        for name, env in stores.items():
            log(f"{name}: {args.rounds} round(s) after {args.warmup} warm-up(s)")
            results[name] = run_ranks(env, args, baseline=name == "local")
            loads.append(loadavg()[0])
    finally:
        stop_s3_server(proc)
        shutil.rmtree(work, ignore_errors=True)
    nbytes = results["local"]["state_bytes"]
    section: dict[str, Any] = {
        "machine": machine_info(),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "tensors": args.tensors,
        "tensor_mib": args.tensor_mib,
        "state_bytes": nbytes,
        "world_size": results["local"]["world_size"],
        "loadavg": loads,
        "stats": {s: {m: stats(v, nbytes) for m, v in r["samples"].items()} for s, r in results.items()},
        "samples": {s: r["samples"] for s, r in results.items()},
    }
    section["async_blocked_ratio"] = {
        s: st["async"]["median_blocked_s"] / st["sync"]["median_blocked_s"]
        for s, st in section["stats"].items()
    }
    print(json.dumps({k: section[k] for k in ("stats", "async_blocked_ratio")}, indent=1))
    if not args.no_save:
        update_results("sharded_checkpoints", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
