"""One launch of the trivial DDP workload with N processes, for ``bench/scaling.py``.

``python scaling_run.py --hook --n N``: through ``TorchDistributorHook`` in distributed mode, N Spark
tasks of one process each, on the cluster named by the ``torchdist_bench`` connection.
``torchrun --standalone --nproc_per_node=N scaling_run.py``: rank 0 prints the same result.

Prints one ``RESULT {json}`` line: rank 0's value (its wall-clock start, process group joined and
end) and, for the hook, the time around ``hook.run``.
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

CONN_ID = "torchdist_bench"


def check(value: dict, n: int) -> None:
    assert value["world_size"] == n and value["allreduce"] == n * (n + 1) / 2, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hook", action="store_true")
    parser.add_argument("--n", type=int)
    args = parser.parse_args()
    if not args.hook:  # under torchrun
        value = train()
        if os.environ.get("RANK") == "0":
            check(value, int(os.environ["WORLD_SIZE"]))
            print("RESULT " + json.dumps({"value": value, "t_process": T_PROCESS}), flush=True)
        return
    from airflow_provider_torchdist import TorchDistributorHook

    hook = TorchDistributorHook(
        num_processes=args.n,
        local_mode=False,
        use_gpu=False,
        conn_id=CONN_ID,
        conf={"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"},
        env_vars={"SPARK_LOCAL_IP": "127.0.0.1"},
    )
    t_run = time.time()
    value = hook.run(train)
    t_done = time.time()
    check(value, args.n)
    print("RESULT " + json.dumps({"value": value, "t_process": T_PROCESS, "t_run": t_run, "t_done": t_done}))


if __name__ == "__main__":
    main()
