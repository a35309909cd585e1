"""The retry that reattaches: ``python retry_owner.py RECORD_FILE GATE_DIR``.

A fresh interpreter, as a retried task is: imports the hook, reads the record and follows the run
with ``hook.follow``. The first replayed log line marks "reattached" (the lifeline is up,
authenticated both ways, and the missed lines are coming); it then opens the gate and takes rank
0's value. Prints ``RESULT {json}`` with ``t_start``, ``t_reattached``, ``t_done`` and the value.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

T_START = time.time()

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.run_record import RunRecord  # noqa: E402
from airflow_provider_torchdist.spark.output_store import read_output  # noqa: E402


class _FirstLine(logging.Handler):
    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = gate
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None:
            self.at = time.time()
            (self.gate / "release").touch()


def main() -> None:
    record = RunRecord.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    hook = TorchDistributorHook(num_processes=2, local_mode=False, use_gpu=False)
    first = _FirstLine(Path(sys.argv[2]))
    hook.log.addHandler(first)
    value = hook.follow(record, read_output)
    done = time.time()
    assert value == {"world_size": 2}, value
    print(
        "RESULT "
        + json.dumps({"t_start": T_START, "t_reattached": first.at, "t_done": done, "value": value}),
        flush=True,
    )


if __name__ == "__main__":
    main()
