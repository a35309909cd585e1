"""The retry that reattaches: ``python retry_owner.py RECORD_FILE GATE_DIR``.

A fresh interpreter, as a retried task is: imports the hook's modules, reads the record and
becomes the run's owner over the lifeline (``connect_owner``, what ``hook.follow`` does first). The
first replayed log line marks "reattached" (the lifeline is up, authenticated both ways, and the
missed lines are coming); it then opens the gate, waits for the run's end and takes rank 0's value.
Prints ``RESULT {json}`` with ``t_start``, ``t_reattached``, ``t_done`` and the value.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()

import airflow_provider_torchdist.hooks.torch_distributor  # noqa: E402, F401 (what a retry imports)
from airflow_provider_torchdist.spark.wire.output_store import read_output  # noqa: E402
from airflow_provider_torchdist.supervision.lifeline import DoneEvent, LineEvent  # noqa: E402
from airflow_provider_torchdist.supervision.record import RunRecord  # noqa: E402
from airflow_provider_torchdist.supervision.task_side import connect_owner  # noqa: E402


def main() -> None:
    record = RunRecord.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    gate = Path(sys.argv[2])
    reattached = status = None
    with connect_owner(record) as owner:
        for event in owner.events():
            if isinstance(event, LineEvent) and reattached is None:
                reattached = time.time()
                (gate / "release").touch()
            elif isinstance(event, DoneEvent):
                status = event.status
        assert status is not None and status.state == "succeeded", status
        with tempfile.TemporaryDirectory() as tmp:
            value = read_output(owner.fetch_output(Path(tmp)))
        owner.release()
    done = time.time()
    assert value == {"world_size": 2}, value
    print(
        "RESULT "
        + json.dumps({"t_start": T_START, "t_reattached": reattached, "t_done": done, "value": value}),
        flush=True,
    )


if __name__ == "__main__":
    main()
