"""The steady-state workload through the operator's path: ``python lm_hook.py --data DIR ...``.

``TorchDistributorHook(train_data="SELECT tokens FROM parquet.`DIR`")``, ``start_run`` + ``follow``
(a detached supervisor owned over the lifeline, as the operator runs it), local_mode=False on the
embedded master; ``--hang-timeout 0`` turns the hang watchdog off. Prints one ``RESULT {json}``
line with rank 0's figures.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm_train import parse_args, train_from_shard  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.spark.wire.output_store import read_output  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    # --hang-timeout 0: the hang watchdog off (the default: the hook's default hang_timeout, on)
    watchdog = {} if args.hang_timeout is None else {"hang_timeout": args.hang_timeout or None}
    hook = TorchDistributorHook(
        num_processes=2, local_mode=False, train_data=f"SELECT tokens FROM parquet.`{args.data}`", **watchdog
    )
    record = hook.start_run(train_from_shard, [args.steps, args.batch], durable=False)
    value = hook.follow(record, read_output)
    print("RESULT " + json.dumps({"value": value}), flush=True)


if __name__ == "__main__":
    main()
