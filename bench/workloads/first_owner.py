"""The first owner of a durable run, to be SIGKILLed: ``python first_owner.py GATE_DIR RECORD_FILE``.

Starts a durable distributed run of :func:`gated_fn.gated` under its supervisor (the operator's
path: ``hook.start_run``), writes the run's record to RECORD_FILE and follows it as a task would,
until the benchmark kills this process.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gated_fn import gated  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.spark.wire.output_store import read_output  # noqa: E402


def main() -> None:
    gate_dir, record_file = sys.argv[1:3]
    hook = TorchDistributorHook(num_processes=2, local_mode=False, use_gpu=False)
    record = hook.start_run(gated, [gate_dir], durable=True, reattach_timeout=120)
    tmp = record_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record.to_dict(), f)
    os.replace(tmp, record_file)
    hook.follow(record, read_output)


if __name__ == "__main__":
    main()
