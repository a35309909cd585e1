"""One output round trip through the hook, with peak-memory sampling.

``python hook_output.py --local|--distributed --mb N --how return|save --dir DIR``

- ``return``: rank 0 returns an N MiB state_dict; here what the operator and a downstream task do:
  ``output_to_xcom`` with the operator's default inline limit (above it: the pickle is stored
  under ``DIR/outputs``, on the staging directory's filesystem, and XCom gets a signed reference),
  then ``load_output`` of that XCom value after its JSON round trip;
- ``save``: rank 0 ``torch.save``s it to DIR; here ``torch.load`` (the local-disk baseline).

The output file's mtime tells when the driver had rank 0's value. A sampler thread reads the peak
RSS (``VmHWM``) of this process and of every process under it; ranks are identified by the pid
files they write. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import torch  # noqa: E402  (imported up front: the round trip, not torch's import, is measured)
from output_fn import big_state_dict  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.outputs.results import (  # noqa: E402
    DEFAULT_MAX_XCOM_OUTPUT_BYTES,
    load_output,
    output_to_xcom,
)


def vm_hwm_kib(pid: int | str = "self") -> int:
    """Peak resident set size (``VmHWM``) of a process, KiB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    """Keeps the highest ``VmHWM`` seen for each descendant process (by pid), with its command."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.cmds: dict[int, str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._done.is_set():
            for p in me.children(recursive=True):
                peak = vm_hwm_kib(p.pid)
                if peak > self.peaks.get(p.pid, 0):
                    self.peaks[p.pid] = peak
                    try:  # re-read: a forked child exec()s into its own command after we first see it
                        self.cmds[p.pid] = " ".join(p.cmdline())[:200]
                    except psutil.Error:
                        pass
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    parser.add_argument("--mb", type=int, required=True)
    parser.add_argument("--how", choices=("return", "save"), required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    stamp_dir = Path(args.dir)
    landed: dict[str, float] = {}
    hook = TorchDistributorHook(num_processes=2, local_mode=args.local, use_gpu=False)
    sampler = PeakSampler()
    sampler.start()
    parent_before = vm_hwm_kib()
    rss_before = psutil.Process().memory_info().rss
    t_start = time.time()
    timings: dict[str, float] = {}
    if args.how == "return":
        store_uri = f"file://{stamp_dir}/outputs/dag/run/train-try1.pkl"

        def to_xcom_like_the_operator(path: Path | None) -> object:
            timings["t_got_pickled"] = time.time()
            assert path is not None
            # when the driver finished writing rank 0's output: the file's mtime
            landed["t_output_landed"] = path.stat().st_mtime_ns / 1e9
            out = output_to_xcom(
                path,
                origin={"dag_id": "dag", "run_id": "run", "task_id": "train", "map_index": -1, "try": 1},
                max_inline_bytes=DEFAULT_MAX_XCOM_OUTPUT_BYTES,
                store_uri=store_uri,
                store_base=f"file://{stamp_dir}/outputs",
            )
            timings["t_to_xcom"] = time.time()
            return out

        xcom = hook.run_to_path(big_state_dict, [args.mb, str(stamp_dir)], {}, to_xcom_like_the_operator)
        xcom_text = json.dumps(xcom)  # what XCom stores, and what the downstream task gets
        xcom_chars = len(xcom_text)
        xcom = json.loads(xcom_text)
        timings["t_load_start"] = time.time()
        value = load_output(xcom)
        timings["t_loaded"] = time.time()
        landed["by_reference"] = "ref" in xcom
    else:
        path = stamp_dir / "state.pt"
        saved = hook.run(big_state_dict, args.mb, str(stamp_dir), str(path))
        timings["t_got_pickled"] = time.time()
        timings["t_before_save"], timings["t_saved"] = saved["t_before_save"], saved["t_saved"]
        timings["t_load_start"] = time.time()
        value = torch.load(path)
        timings["t_loaded"] = time.time()
        xcom_chars = 0
    sampler.stop()
    size = sum(t.numel() * t.element_size() for t in value.values())
    pids = {p.name: int(p.read_text()) for p in stamp_dir.glob("rank*.pid")}
    rank_pids = {pid: name.removesuffix(".pid") for name, pid in pids.items()}
    others = {pid: sampler.cmds.get(pid, "") for pid in sampler.peaks if pid not in rank_pids}
    driver = [pid for pid, cmd in others.items() if "torchdist_driver.py" in cmd]
    print(
        "RESULT "
        + json.dumps(
            {
                "t_start": t_start,
                "t_return": float((stamp_dir / "t_return").read_text()),
                **timings,
                **landed,
                "output_bytes": size,
                "xcom_json_chars": xcom_chars,
                "peak_rss_kib": {name: sampler.peaks.get(pid, 0) for pid, name in rank_pids.items()},
                "driver_peak_rss_kib": max((sampler.peaks[p] for p in driver), default=0),
                "parent_hwm_before_kib": parent_before,
                "parent_hwm_after_kib": vm_hwm_kib(),
                "parent_rss_before_kib": rss_before // 1024,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
