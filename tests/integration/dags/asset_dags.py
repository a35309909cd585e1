"""A gated training for the live-metrics and asset tests (``test_assets.py``).

``asset_gated_training`` stands in for ``retrain_pipeline``'s ``train`` (dags/): the same outlet
asset, ``torchdist://models/retrain``, so its success triggers ``evaluate_model`` (dags/), but a
smaller run that the test holds at a gate. The run's ``conf`` names a directory shared with the test
(``{"gate_dir": "/tmp/..."}``); rank 0

1. reports steps 0, 1 and 2 of ``TOTAL_STEPS`` (``report(step=..., total_steps=..., loss=...)``),
2. writes ``<gate_dir>/waiting`` and waits, polling every 0.1 s, until ``<gate_dir>/release``
   exists (rank 1 waits too, so the run goes on),
3. reports the last step and returns ``{"trained": True}``.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import Asset, dag

from airflow_provider_torchdist import TorchDistributorOperator

#: The asset dags/retrain_pipeline.py and dags/evaluate_model.py share.
MODEL = Asset("torchdist://models/retrain")
TOTAL_STEPS = 4
BEFORE_GATE = 3


def train_gated_reporting(gate_dir: str) -> dict[str, Any] | None:
    """Report, wait at the gate, report again (see the module docstring)."""
    import os
    import time
    from pathlib import Path

    from airflow_provider_torchdist import report

    rank, gate = int(os.environ["RANK"]), Path(gate_dir)
    for step in range(BEFORE_GATE):
        report(step=step, total_steps=TOTAL_STEPS, loss=1.0 / (step + 1))
    if rank == 0:
        (gate / "waiting").write_text(str(os.getpid()))
    while not (gate / "release").exists():
        time.sleep(0.1)
    report(step=TOTAL_STEPS - 1, total_steps=TOTAL_STEPS, loss=0.125)
    return {"trained": True} if rank == 0 else None


@dag(
    dag_id="asset_gated_training",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist-test"],
)
def asset_gated_training():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_gated_reporting,
        kwargs={"gate_dir": "{{ dag_run.conf['gate_dir'] }}"},
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        outlets=[MODEL],
    )


asset_gated_training()
