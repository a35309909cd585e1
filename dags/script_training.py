"""Script mode: train with a stand-alone ``torchrun``-style script instead of a callable.

``train_object`` is the script's path on the worker and ``args`` its command line, exactly what
``torchrun scripts/train_script.py --epochs 8 --lr 0.1`` would get. A script returns nothing, so
the task's XCom value is None; its output (one line per rank) is in the task log, and a non-zero
exit fails the task with the rank's exit code.
"""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

#: Absolute, so it does not depend on the worker's working directory.
TRAIN_SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_script.py"


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist", "example"],
    doc_md=__doc__,
)
def script_training():
    TorchDistributorOperator(
        task_id="train",
        train_object=str(TRAIN_SCRIPT),
        args=["--epochs", "8", "--lr", "0.1"],
        num_processes=2,
        local_mode=False,
        use_gpu=False,
    )


script_training()
