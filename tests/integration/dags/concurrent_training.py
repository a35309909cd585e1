"""A DAG for the PostgreSQL deployment test: three of its runs train at once, each to its own target.

``concurrent_training`` trains ``y = target * x`` with two ranks (``num_processes=2``, distributed
mode on the embedded Spark master), ``target`` from the run's ``conf``, so each run's result says
which run it belongs to. Up to three runs, and their tasks, run at once.

Training is gated on a file the test controls, never on a sleep, which makes the runs' training
overlap by construction. The ``conf`` names a directory shared with the test and the run
(``{"gate_dir": "/tmp/...", "name": "a", "target": 1.5}``); each rank, once both ranks of its run
have joined the process group,

1. notes ``time.time()`` as its start and writes its pid to ``<gate_dir>/training-<name>-<rank>``,
2. waits, polling every 0.1 s, until ``<gate_dir>/release`` exists (at most ``GATE_TIMEOUT`` s),
3. trains for ``EPOCHS`` epochs, reporting ``weight`` and ``loss`` each epoch (every rank),
4. notes ``time.time()`` as its end.

Rank 0 returns ``{"name": ..., "target": ..., "weight": ..., "world_size": 2, "epochs": 40,
"spans": [[start, end] of rank 0, [start, end] of rank 1]}``.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import dag

from airflow_provider_torchdist import TorchDistributorOperator

CONCURRENT_RUNS = 3
EPOCHS = 40
#: Seconds a rank waits at the gate before it gives up (the test opens it within seconds).
GATE_TIMEOUT = 600


def train_to_target(gate_dir: str, name: str, target: str | float) -> dict[str, Any] | None:
    """Fit ``w`` in ``y = w * x`` to ``target`` with DDP over gloo, after the gate opens."""
    import os
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_torchdist import report

    target = float(target)  # a rendered template arrives as a string
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    started = time.time()
    gate = Path(gate_dir)
    (gate / f"training-{name}-{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + GATE_TIMEOUT
    while not (gate / "release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} of {name}: {gate / 'release'} not there after {GATE_TIMEOUT} s")
        time.sleep(0.1)

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 1, generator=generator)
    y = target * x
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for epoch in range(EPOCHS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(step=epoch, all_ranks=True, loss=loss, weight=model.module.weight.item())
    ended = time.time()

    spans: list[Any] = [None] * world_size
    dist.all_gather_object(spans, [started, ended])
    weight = model.module.weight.item()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "name": name,
        "target": target,
        "weight": weight,
        "world_size": world_size,
        "epochs": EPOCHS,
        "spans": spans,
    }


@dag(
    dag_id="concurrent_training",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=CONCURRENT_RUNS,
    max_active_tasks=CONCURRENT_RUNS,
    tags=["torchdist-test"],
)
def concurrent_training():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_to_target,
        kwargs={
            "gate_dir": "{{ dag_run.conf['gate_dir'] }}",
            "name": "{{ dag_run.conf['name'] }}",
            "target": "{{ dag_run.conf['target'] }}",
        },
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        retries=0,
    )


concurrent_training()
