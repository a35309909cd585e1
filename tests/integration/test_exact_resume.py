"""Exact resume of ``train_data``, for real (issue 43): a 2-rank DDP run over 3 epochs of
``rank_batches(..., epoch=e)``, with dropout and ``torch.rand`` noise (so the random generators
matter), is stopped gracefully at step 37 (mid-epoch 2) and resumed; its final weights equal, bit
for bit, those of the same run never stopped. The stop is Airflow's (``on_kill`` with a
``stop_grace_period``): the ranks see ``stop_requested()``, checkpoint and return.

Three local-mode runs of a 128-row query (one Spark application each), gated on the marker the
training writes when it reaches the stop step, not on sleeps.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.spark.wire.output_store import read_output

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

STOP_AT = 37  # of 48: 3 epochs of 16 batches of 4 rows on each rank; epoch 2, batch 5
QUERY = (
    "SELECT CAST(id % 7 AS FLOAT) AS a, CAST(id % 5 AS FLOAT) AS b, CAST(id % 3 AS FLOAT) AS c, "
    "CAST(id % 11 AS FLOAT) / 10 AS y FROM range(128)"
)


def train_three_epochs(marker_dir: str, stop_at: int | None) -> dict[str, Any]:
    """The documented loop: resume, then every rank checkpoints after its step. With ``stop_at``,
    rank 0 says when that step is trained and every rank waits there for the graceful stop."""
    import torch
    import torch.distributed as dist

    from airflow_provider_torchdist import (
        load_latest_checkpoint,
        rank_batches,
        save_checkpoint,
        stop_requested,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    step, loaded = load_latest_checkpoint() or (0, None)
    if loaded:
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    start, trained = step, 0
    for epoch in range(3):
        for batch in rank_batches(4, epoch=epoch):
            x = torch.stack([batch["a"], batch["b"], batch["c"]], dim=1)
            x = x + 0.1 * torch.rand_like(x)  # the generators matter
            loss = ((ddp(x).squeeze(1) - batch["y"]) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step, trained = step + 1, trained + 1
            if step % 10 == 0:
                save_checkpoint(state(), step)
            if step == stop_at:
                if rank == 0:
                    Path(marker_dir, "at-stop").write_text(str(step))
                while not stop_requested(all_ranks=True):  # the test stops the run on the marker
                    time.sleep(0.05)
                save_checkpoint(state(), step)
                return {"stopped_at": step}
    weights = {name: t.detach().numpy().tobytes().hex() for name, t in model.state_dict().items()}
    dist.destroy_process_group()
    return {"started_at": start, "trained": trained, "weights": weights}


def hook(checkpoints: Path) -> TorchDistributorHook:
    return TorchDistributorHook(
        num_processes=2,
        train_data=QUERY,
        train_data_shuffle_seed=11,
        checkpoint_dir=str(checkpoints),
        stop_grace_period=60,
    )


def test_a_run_stopped_at_step_37_and_resumed_ends_bitwise_where_an_unstopped_one_does(
    tmp_path: Path,
) -> None:
    unstopped = hook(tmp_path / "unstopped").run(train_three_epochs, str(tmp_path), None)
    assert unstopped["started_at"] == 0 and unstopped["trained"] == 48

    # Supervised, as the operator runs it: a kill then is a graceful stop (stop_grace_period).
    stopping = hook(tmp_path / "ckpt")
    record = stopping.start_run(train_three_epochs, [str(tmp_path), STOP_AT], {}, durable=False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stopping.follow(record, read_output)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "at-stop").exists():
        assert runner.is_alive() and time.monotonic() < deadline, f"never reached step {STOP_AT}: {errors}"
        time.sleep(0.1)
    stopping.on_kill()  # Airflow's kill: the ranks see stop_requested(), checkpoint and return
    runner.join(90)
    assert not runner.is_alive() and len(errors) == 1, errors  # a killed run is not a success
    positions = tmp_path / "ckpt" / "positions"
    at_stop = [json.loads(p.read_text())["position"] for p in positions.glob("step-000000037-*/rank-*.json")]
    assert [(p["epoch"], p["batches"]) for p in at_stop] == [(2, 5), (2, 5)]  # each rank's, whole

    resumed = hook(tmp_path / "ckpt").run(train_three_epochs, str(tmp_path), None)
    assert resumed["started_at"] == STOP_AT and resumed["trained"] == 48 - STOP_AT
    assert resumed["weights"] == unstopped["weights"]
