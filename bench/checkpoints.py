"""Checkpoint save and restore throughput: the checkpoint store against a hand-written baseline.

Usage: ``python bench/checkpoints.py [--rounds 3] [--warmup 1] [--tensors 16] [--tensor-mib 64] [--no-save]``

The state: ``--tensors`` float32 tensors of ``--tensor-mib`` MiB (16 of 64 MiB: 1 GiB), made once,
seed 0. Two stores: a local temp dir (the filesystem of /tmp), and a real S3-compatible server,
moto's standalone server in a process of its own started and stopped by its PID with
``tests/object_store.py``'s helpers, reached over HTTP by s3fs. On each, two variants:

- **torchdist**: ``save_checkpoint(state, step)`` and ``load_latest_checkpoint()`` with the
  environment a rank gets (``TORCHDIST_CHECKPOINT_DIR``, ``TORCHDIST_CHECKPOINT_STORAGE_OPTIONS``
  for S3, ``RANK=0``, the run's identity). The store streams ``torch.save`` into a private temp
  file, fsyncs it, reads it back for its SHA-256, renames (local) or uploads (S3) it and writes
  the manifest; a restore lists the store, reads the manifest, copies the object to a temp file
  (S3), checks its SHA-256, then ``torch.load(weights_only=True)``.
- **baseline**: ``torch.save(state, path)`` to a local file, then (S3) ``fs.put_file``; restore:
  (S3) ``fs.get_file`` to a local file, then ``torch.load(weights_only=True)``. No fsync, no hash.

Rounds interleave the variants (order alternating by round) after ``--warmup`` uncounted rounds,
into fresh directories and step numbers deleted after each (moto keeps what it stores). The page
cache cannot be dropped (no root): a restore reads what was just written, both variants alike.
Results (median GB/s, 10^9 bytes/s; torchdist / baseline; where the time goes) go to the
``checkpoints`` section of ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock  # patch.dict: the rank's environment for a block, then as it was

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests' S3 server, the package

import torch  # noqa: E402
from common import loadavg, log, machine_info, median, update_results  # noqa: E402

from airflow_provider_torchdist.spark.node import checkpoint_manifest as ckpt  # noqa: E402
from airflow_provider_torchdist.spark.node import checkpoint_store, checkpoints  # noqa: E402
from airflow_provider_torchdist.spark.node.checkpoint_io import StoreObjects  # noqa: E402
from tests.object_store import S3Server, start_s3_server, stop_s3_server  # noqa: E402

GB = 1e9
VARIANTS = ("torchdist", "baseline")
#: Where the store's save and restore spend their time: (owner, attribute, part). The rest of a save
#: is "other" (fsync, manifest, listing, retention); the rest of a restore is "fetch" (listing, the
#: manifest, opening or downloading the object).
SAVE_PARTS = [
    (checkpoints, "dump_state", "serialize"),
    (checkpoint_store, "digest", "sha256"),
    (StoreObjects, "_put", "place"),
]
RESTORE_PARTS = [(checkpoints, "load_state", "deserialize"), (checkpoint_store, "digest", "sha256")]


def make_state(tensors: int, mib: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``mib`` MiB each, the same every run (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.randn(mib * 2**18, generator=gen) for i in range(tensors)}


@contextlib.contextmanager
def timed_calls(targets: list[tuple[Any, str, str]]) -> Iterator[dict[str, float]]:
    """Seconds spent in each named function while the block runs (wrapped, then put back)."""
    spent = dict.fromkeys((part for _, _, part in targets), 0.0)
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    for (owner, attr, original), (_, _, part) in zip(originals, targets, strict=True):

        def wrapper(*args: Any, _original: Any = original, _part: str = part, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_part] += time.perf_counter() - start

        setattr(owner, attr, wrapper)
    try:
        yield spent
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


class Store:
    """Where one round's checkpoints go: a local directory, or a bucket of the S3 server."""

    def __init__(self, name: str, work: Path, server: S3Server | None = None) -> None:
        self.name, self.work, self.server = name, work, server
        work.mkdir()
        self.fs = server.filesystem() if server else None  # the baseline's one long-lived client
        self.bucket = server.bucket() if server else None

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}" if self.server else str(self.work / prefix)

    def env(self, prefix: str, round_no: int) -> dict[str, str]:
        """What a rank of task ``train`` of DAG run ``round-N`` finds in its environment."""
        env = {
            ckpt.CHECKPOINT_ENV: self.uri(prefix),
            "RANK": "0",
            ckpt.RUN_ENV: ckpt.run_env("bench_checkpoints", f"round-{round_no}", "train", -1, 1),
        }
        options = {ckpt.STORAGE_OPTIONS_ENV: json.dumps(self.server.storage_options)} if self.server else {}
        return {**env, **options}

    def clean(self, prefix: str) -> None:
        """Delete what a round wrote under ``prefix``."""
        if self.fs is not None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(f"{self.bucket}/{prefix}", recursive=True)
        shutil.rmtree(self.work / prefix, ignore_errors=True)


def check_restored(state: dict[str, torch.Tensor], loaded: Any) -> None:
    """The restored state is the saved one, tensor for tensor (outside the timing)."""
    if not isinstance(loaded, dict) or loaded.keys() != state.keys():
        raise AssertionError(f"restored a different state: {type(loaded).__name__}")
    for key, tensor in state.items():
        if not torch.equal(tensor, loaded[key]):
            raise AssertionError(f"restored {key} differs from the saved tensor")


def run_torchdist(store: Store, state: dict[str, torch.Tensor], round_no: int) -> dict[str, Any]:
    """``save_checkpoint`` then ``load_latest_checkpoint`` into a fresh directory."""
    prefix, step = f"r{round_no}-torchdist", round_no + 1
    with mock.patch.dict(os.environ, store.env(prefix, round_no)), contextlib.redirect_stdout(io.StringIO()):
        with timed_calls(SAVE_PARTS) as save_parts:
            start = time.perf_counter()
            if checkpoints.save_checkpoint(state, step) is None:
                raise RuntimeError("save_checkpoint wrote nothing (RANK is not 0?)")
            save_s = time.perf_counter() - start
        with timed_calls(RESTORE_PARTS) as restore_parts:
            start = time.perf_counter()
            found = checkpoints.load_latest_checkpoint()
            restore_s = time.perf_counter() - start
    if found is None or found[0] != step:
        raise RuntimeError(f"load_latest_checkpoint found {found and found[0]}, not step {step}")
    check_restored(state, found[1])
    save_parts["other"] = save_s - sum(save_parts.values())
    restore_parts["fetch"] = restore_s - sum(restore_parts.values())
    return {
        "save_s": save_s,
        "restore_s": restore_s,
        "save_parts": save_parts,
        "restore_parts": restore_parts,
    }


def run_baseline(store: Store, state: dict[str, torch.Tensor], round_no: int) -> dict[str, Any]:
    """``torch.save`` to a local file (then ``put_file``); ``get_file`` (S3) then ``torch.load``."""
    prefix = f"r{round_no}-baseline"
    local = store.work / prefix / "state.pt"
    local.parent.mkdir()
    remote = f"{store.bucket}/{prefix}/state.pt"
    t0 = time.perf_counter()
    torch.save(state, local)
    t1 = time.perf_counter()
    if store.fs is not None:
        store.fs.put_file(str(local), remote)
        local.unlink()  # the store removes its temp file too
    t2 = time.perf_counter()
    if store.fs is not None:
        store.fs.get_file(remote, str(local))
    t3 = time.perf_counter()
    loaded = torch.load(local, map_location="cpu", weights_only=True)
    t4 = time.perf_counter()
    check_restored(state, loaded)
    return {
        "save_s": t2 - t0,
        "restore_s": t4 - t2,
        # No hash, no fsync; locally nothing to place or fetch.
        "save_parts": {"serialize": t1 - t0, **({"place": t2 - t1} if store.fs else {})},
        "restore_parts": {**({"fetch": t3 - t2} if store.fs else {}), "deserialize": t4 - t3},
    }


RUNS = {"torchdist": run_torchdist, "baseline": run_baseline}


def one_sample(store: Store, variant: str, state: dict, step: int, nbytes: int) -> dict[str, Any]:
    """One save and restore of ``variant`` into fresh directories (deleted after), rounded."""
    try:
        value = RUNS[variant](store, state, step)
    finally:
        store.clean(f"r{step}-{variant}")
    value.update(save_gb_s=nbytes / value["save_s"] / GB, restore_gb_s=nbytes / value["restore_s"] / GB)
    return {
        k: {p: round(s, 3) for p, s in v.items()} if isinstance(v, dict) else round(v, 3)
        for k, v in value.items()
    }


def run_rounds(stores: list[Store], state: dict, rounds: int, warmup: int, nbytes: int) -> dict[str, Any]:
    """``warmup`` uncounted rounds, then ``rounds``: every store, both variants (their order
    alternating by round); the counted samples by store and variant."""
    samples: dict[str, dict[str, list]] = {s.name: {v: [] for v in VARIANTS} for s in stores}
    for round_no in range(1 - warmup, rounds + 1):
        for store in stores:
            for variant in VARIANTS if round_no % 2 else VARIANTS[::-1]:
                load_before = loadavg()
                sample = one_sample(store, variant, state, round_no + warmup, nbytes)
                log(
                    f"{f'round {round_no}/{rounds}' if round_no > 0 else 'warm-up'} {store.name} {variant}: "
                    f"save {sample['save_s']:.2f} s ({sample['save_gb_s']:.2f} GB/s), restore "
                    f"{sample['restore_s']:.2f} s ({sample['restore_gb_s']:.2f} GB/s)"
                )
                if round_no > 0:
                    samples[store.name][variant].append(
                        {"round": round_no, **sample, "load_before": load_before}
                    )
    return samples


def variant_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one store's variant: GB/s, seconds, and each part of a save and a restore."""
    stats: dict[str, Any] = {
        f"median_{key}": median([r[key] for r in runs])
        for key in ("save_gb_s", "restore_gb_s", "save_s", "restore_s")
    }
    for kind in ("save_parts", "restore_parts"):
        stats[f"median_{kind}"] = (
            {part: median([r[kind][part] for r in runs]) for part in runs[0][kind]} if runs else {}
        )
    return {**stats, "n": len(runs)}


def summarize(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians per store and variant, and torchdist / baseline of the median GB/s."""
    stats = {
        store: {v: variant_stats(runs) for v, runs in variants.items()} for store, variants in samples.items()
    }
    ratios = {}
    for store, st in stats.items():
        ours, base = st["torchdist"], st["baseline"]
        ratios[store] = {
            kind: round(ours[key] / base[key], 3) if ours[key] and base[key] else None
            for kind, key in (("save", "median_save_gb_s"), ("restore", "median_restore_gb_s"))
        }
    return {"stats": stats, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds first")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so the finally below stops the S3 server and removes the files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = machine_info()
    log(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['mem_gib']} GiB")
    state = make_state(args.tensors, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    log(f"state: {args.tensors} float32 tensors of {args.tensor_mib} MiB, {nbytes / GB:.3f} GB")
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
    proc = None
    try:
        proc, server = start_s3_server(work / "moto.log")
        log(f"moto S3 server on {server.endpoint} (pid {server.pid})")
        stores = [Store("local", work / "local"), Store("s3", work / "s3-scratch", server)]
        samples = run_rounds(stores, state, args.rounds, args.warmup, nbytes)
    finally:
        if proc is not None:
            stop_s3_server(proc)
            log(f"moto S3 server (pid {proc.pid}) stopped: exit status {proc.returncode}")
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(samples)
    for store, variants in summary["stats"].items():
        medians = {
            v: (st["median_save_gb_s"], st["median_restore_gb_s"], st["n"]) for v, st in variants.items()
        }
        log(f"{store}: (save, restore GB/s, n) {medians}; torchdist / baseline {summary['ratios'][store]}")
    if not args.no_save:
        params = {k: getattr(args, k) for k in ("rounds", "warmup", "tensors", "tensor_mib")}
        results = {"machine": machine, **params, "state_bytes": nbytes, "tmp_dir": tempfile.gettempdir()}
        update_results("checkpoints", {**results, **summary, "samples": samples})
        from report import render_docs

        render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
