"""The DAG of the Training view test: a deferred run that reports with ``total_steps`` and stops
half-way at a gate the test opens, so "while the run is going" is a state the test holds.

The run's ``conf`` names a directory shared with the test (``{"gate_dir": "/tmp/..."}``). Rank 0
reports ``loss`` and ``accuracy`` (:func:`figures`) for steps ``0 .. GATE_STEP - 1``, 0.2 s apart,
writes ``<gate_dir>/reported``, waits until ``<gate_dir>/release`` exists, then reports the steps up
to ``STEPS - 1`` and returns ``{"steps": STEPS}``. Rank 1 only waits at the gate.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

STEPS = 8
GATE_STEP = 4
WORLD_SIZE = 2


def figures(step: int) -> dict[str, float]:
    """What rank 0 reports at ``step`` (the test checks the view against the same numbers)."""
    return {"loss": round(2.0 / (step + 1), 4), "accuracy": round(step / STEPS, 4)}


def train_gated(gate_dir: str, steps: int, gate_step: int) -> dict[str, int] | None:
    import os
    import time
    from pathlib import Path

    from airflow_provider_torchdist import report

    rank = int(os.environ["RANK"])
    gate = Path(gate_dir)

    def steps_between(first: int, last: int) -> None:
        for step in range(first, last):
            if rank == 0:
                report(step=step, total_steps=steps, **figures(step))
            time.sleep(0.2)

    steps_between(0, gate_step)
    if rank == 0:
        (gate / "reported").write_text(str(gate_step))
    while not (gate / "release").exists():
        time.sleep(0.1)
    steps_between(gate_step, steps)
    return {"steps": steps} if rank == 0 else None


@dag(dag_id="training_view", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def training_view():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_gated,
        kwargs={"gate_dir": "{{ dag_run.conf['gate_dir'] }}", "steps": STEPS, "gate_step": GATE_STEP},
        num_processes=WORLD_SIZE,
        local_mode=True,
        use_gpu=False,
        deferrable=True,
    )


training_view()
