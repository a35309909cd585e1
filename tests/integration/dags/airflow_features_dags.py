"""DAGs for the Airflow-feature tests (tests/integration/test_airflow_features.py): the operator in
the features users combine it with, through the shared deployment's real scheduler.

The run's ``conf`` names a directory shared with the test (``{"gate_dir": "/tmp/..."}``).

- ``features_sweep``: a hyper-parameter sweep of a *callable*, ``partial(...).expand(kwargs=...)``
  over three learning rates, distributed with 2 processes each, ``max_active_tis_per_dag=1`` (one
  trial on the cluster at a time), ``map_index_template`` naming each trial ``lr=...``; ``best``
  opens each trial's output with ``load_output`` (bound to its own map index) and picks the
  lowest loss.
- ``features_sweep_deferrable``: the same sweep through ``expand_kwargs`` (over ``kwargs`` and
  ``num_processes``), deferrable, in the pool ``torchdist_sweep`` (1 slot, deferred tasks
  counted: the test creates it). Each trial waits at ``<gate_dir>/release-<lr>`` once its ranks
  have trained, so the test opens it only once the task is deferred.
- ``features_timeout_deferred``: deferrable, ``execution_timeout`` 45 s, the ranks wait at a gate
  that never opens: the trigger stops the run at the deadline, and the try times out.
- ``features_timeout_retry``: durable, ``retries=1`` with ``retry_exponential_backoff``,
  ``execution_timeout`` 75 s, the ranks wait at a gate that never opens. The test SIGKILLs try
  1's process; try 2 reattaches to the same run and gets only what is left of the 75 s.
- ``features_task_group``: in a task group, a setup task makes a workspace, the training task
  gets its path through ``args`` (an XComArg, resolved at render) and reads it on every rank, and
  a teardown task removes it.

Every rank appends its pid to ``<gate_dir>/started-<tag>-<rank>`` when it starts (``tag``: the
trial's ``lr``, or ``run``), so the test counts starts and finds the ranks by PID.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output

START = pendulum.datetime(2026, 1, 1, tz="UTC")
GATE_DIR = "{{ dag_run.conf['gate_dir'] }}"
#: Two trials: enough to show each trains with its own value, one at a time.
LEARNING_RATES = [0.05, 0.3]
#: Seconds a rank waits at a gate before it gives up (the tests open theirs within seconds, or
#: stop the run long before).
GATE_TIMEOUT = 600
#: The deferred run's execution_timeout: long enough for its ranks to start on a loaded machine.
DEFERRED_TIMEOUT_S = 45
#: The durable run's: its first try is killed once its ranks train, its retry takes the run over.
RETRY_TIMEOUT_S = 75


def fit(gate_dir: str, *, lr: float, steps: int = 20, gated: bool = False) -> dict[str, Any] | None:
    """Fit ``w`` to 3.0 with DDP over gloo at learning rate ``lr``; rank 0 returns the trial's
    figures with its weight as a tensor (so the value goes to XCom as a signed envelope)."""
    import os
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_torchdist import report

    gate = Path(gate_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(gate / f"started-{lr}-{rank}", "a") as started:
        started.write(f"{os.getpid()} {time.time()}\n")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    torch.nn.init.zeros_(model.module.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.ones(8, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), 3.0 * x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(step=step, total_steps=steps, loss=loss)
    final = torch.nn.functional.mse_loss(model(x), 3.0 * x).item()
    if gated:  # a deferrable trial: the test opens it once the task is deferred
        deadline = time.monotonic() + GATE_TIMEOUT
        while not (gate / f"release-{lr}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    dist.destroy_process_group()
    with open(gate / f"ended-{lr}-{rank}", "a") as ended:
        ended.write(f"{time.time()}\n")
    if rank != 0:
        return None
    return {"lr": lr, "loss": final, "world": world, "weight": model.module.weight.detach().clone()}


@task
def best(values: list[Any]) -> dict[str, Any]:
    """The trial with the lowest loss; each output opened with ``load_output``, checked to be its
    own map index's (the signed origin), in map order."""
    trials = []
    for map_index, value in enumerate(values):
        result = load_output(value, expect={"map_index": map_index})
        trials.append({"lr": result["lr"], "loss": result["loss"], "world": result["world"]})
    assert [t["lr"] for t in trials] == LEARNING_RATES, trials
    return {"best": min(trials, key=lambda t: t["loss"]), "trials": trials}


@dag(dag_id="features_sweep", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def features_sweep():
    trials = TorchDistributorOperator.partial(
        task_id="train",
        train_object=fit,
        args=[GATE_DIR],
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        max_active_tis_per_dag=1,
        map_index_template="lr={{ task.train_kwargs['lr'] }}",
    ).expand(kwargs=[{"lr": lr} for lr in LEARNING_RATES])
    best(trials.output)


@dag(
    dag_id="features_sweep_deferrable",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=["torchdist-test"],
)
def features_sweep_deferrable():
    trials = TorchDistributorOperator.partial(
        task_id="train",
        train_object=fit,
        args=[GATE_DIR],
        local_mode=False,
        use_gpu=False,
        deferrable=True,
        pool="torchdist_sweep",
        map_index_template="lr={{ task.train_kwargs['lr'] }}",
    ).expand_kwargs([{"kwargs": {"lr": lr, "gated": True}, "num_processes": 2} for lr in LEARNING_RATES])
    best(trials.output)


def wait_at_the_gate(gate_dir: str) -> None:
    """Start, then wait at a gate that never opens (the run is stopped at its deadline)."""
    import os
    import time
    from pathlib import Path

    rank = int(os.environ["RANK"])
    gate = Path(gate_dir)
    with open(gate / f"started-run-{rank}", "a") as started:
        started.write(f"{os.getpid()} {time.time()}\n")
    deadline = time.monotonic() + GATE_TIMEOUT
    while not (gate / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


@dag(
    dag_id="features_timeout_deferred",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=["torchdist-test"],
)
def features_timeout_deferred():
    TorchDistributorOperator(
        task_id="train",
        train_object=wait_at_the_gate,
        args=[GATE_DIR],
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        deferrable=True,
        retries=0,
        execution_timeout=timedelta(seconds=DEFERRED_TIMEOUT_S),
    )


@dag(
    dag_id="features_timeout_retry",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=["torchdist-test"],
)
def features_timeout_retry():
    TorchDistributorOperator(
        task_id="train",
        train_object=wait_at_the_gate,
        args=[GATE_DIR],
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        durable=True,
        retries=1,
        retry_delay=timedelta(seconds=1),
        retry_exponential_backoff=True,
        execution_timeout=timedelta(seconds=RETRY_TIMEOUT_S),
    )


def read_workspace(workspace: str) -> str | None:
    import os
    from pathlib import Path

    rank = int(os.environ["RANK"])
    seen = (Path(workspace) / "ready").read_text()
    (Path(workspace) / f"rank-{rank}").write_text(seen)
    return seen if rank == 0 else None


@task
def make_workspace(gate_dir: str) -> str:
    from pathlib import Path

    workspace = Path(gate_dir) / "workspace"
    workspace.mkdir()
    (workspace / "ready").write_text("ready")
    return str(workspace)


@task
def remove_workspace(workspace: str) -> None:
    import shutil
    from pathlib import Path

    ranks = sorted(p.name for p in Path(workspace).glob("rank-*"))
    assert ranks == ["rank-0", "rank-1"], ranks
    shutil.rmtree(workspace)
    (Path(workspace).parent / "torn-down").write_text(" ".join(ranks))


@dag(dag_id="features_task_group", schedule=None, start_date=START, catchup=False, tags=["torchdist-test"])
def features_task_group():
    from airflow.sdk import TaskGroup

    with TaskGroup("training"):
        workspace = make_workspace(GATE_DIR)
        train = TorchDistributorOperator(
            task_id="train",
            train_object=read_workspace,
            args=[workspace],
            num_processes=2,
            local_mode=True,
            use_gpu=False,
        )
        teardown = remove_workspace(workspace).as_teardown(setups=workspace)
        workspace >> train >> teardown


features_sweep()
features_sweep_deferrable()
features_task_group()
features_timeout_deferred()
features_timeout_retry()
