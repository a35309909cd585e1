"""Run one workload function through the hook and print its (JSON-able) value.

``python hook_call.py MODULE:FUNCTION --local|--distributed [--nproc-per-node N] [--hang-timeout S]
[--kwargs JSON]`` (``--hang-timeout 0``: the hang watchdog off; by default the hook's default).
with MODULE a file in this directory. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", help="MODULE:FUNCTION")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--hang-timeout", type=float, default=None, help="0: the hang watchdog off")
    parser.add_argument("--kwargs", default="{}", help="keyword arguments, as JSON")
    args = parser.parse_args()
    module, _, name = args.target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    watchdog = {} if args.hang_timeout is None else {"hang_timeout": args.hang_timeout or None}
    hook = TorchDistributorHook(
        num_processes=2, local_mode=args.local, use_gpu=False, nproc_per_node=args.nproc_per_node, **watchdog
    )
    start = time.time()
    value = hook.run(fn, **json.loads(args.kwargs))
    print("RESULT " + json.dumps({"value": value, "run_s": time.time() - start}), flush=True)


if __name__ == "__main__":
    main()
