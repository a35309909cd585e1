"""One failing run through the hook: ``python hook_fail.py --local|--distributed STAMP_FILE``.

Prints ``RESULT {json}`` with when rank 1 raised (from STAMP_FILE), when ``hook.run`` raised here,
and the exception's type and first line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fail_fn import fail_rank_one  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    parser.add_argument("stamp_file")
    args = parser.parse_args()
    hook = TorchDistributorHook(num_processes=2, local_mode=args.local, use_gpu=False)
    start = time.time()
    try:
        hook.run(fail_rank_one, args.stamp_file)
    except Exception as exc:
        caught = time.time()
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    else:
        raise SystemExit("the run did not fail")
    with open(args.stamp_file) as f:
        raised = float(f.read())
    print(
        "RESULT "
        + json.dumps({"t_start": start, "t_rank_raised": raised, "t_hook_raised": caught, "error": error}),
        flush=True,
    )


if __name__ == "__main__":
    main()
