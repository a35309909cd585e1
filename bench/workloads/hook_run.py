"""One launch through this project's hook: ``python hook_run.py --local|--distributed [--conn-id ID]``.

A fresh interpreter per sample, so importing Airflow, the hook and cloudpickle counts. Prints one
``RESULT {json}`` line with rank 0's value and the time spent inside ``hook.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROCESS = time.time()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_trivial import train  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.spark.wire.output_store import read_output  # noqa: E402

T_IMPORTED = time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true", help="local_mode=True: ranks on the Spark driver")
    mode.add_argument("--distributed", action="store_true", help="local_mode=False: a barrier stage")
    parser.add_argument(
        "--supervised",
        action="store_true",
        help="the operator's path: a detached supervisor owned over the lifeline (start_run + follow)",
    )
    parser.add_argument(
        "--conn-id",
        default="spark_default",
        help="a spark_connect connection: the run goes through Spark Connect",
    )
    args = parser.parse_args()
    hook = TorchDistributorHook(num_processes=2, local_mode=args.local, use_gpu=False, conn_id=args.conn_id)
    t_run = time.time()
    if args.supervised:
        record = hook.start_run(train, durable=False)
        value = hook.follow(record, read_output)
    else:
        value = hook.run(train)
    t_done = time.time()
    assert value["world_size"] == 2 and value["allreduce"] == 3.0, value
    timing = {"import_s": T_IMPORTED - T_PROCESS, "run_s": t_done - t_run, "t_run": t_run, "t_done": t_done}
    print("RESULT " + json.dumps({"value": value, **timing}), flush=True)


if __name__ == "__main__":
    main()
