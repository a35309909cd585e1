"""Training triggered by hand: the trigger form (or the REST API's ``conf``) sets the run's shape.

Every field of the form is a typed :class:`~airflow.sdk.Param` with bounds, so a bad value is
refused when the run is triggered, before anything starts: ``num_processes=9`` is a validation
error in the UI and a ``400`` from ``POST /api/v2/dags/ui_triggered_training/dagRuns``.

The operator takes the values through templates. A rendered template is a string, so the
operator converts ``num_processes`` and ``local_mode`` itself, and :func:`train` converts its
``lr`` and ``epochs`` arguments.

Its result is a plain JSON dict, so XCom's ``return_value`` of ``train`` is readable as is. With
the form's defaults, which are also the conf the README triggers it with (``num_processes=2``,
``local_mode=false``, ``learning_rate=0.1``, ``epochs=5``), it is
``{"rank": 0, "world_size": 2, "loss": 0.000105, "learning_rate": 0.1, "epochs": 5}``: the loss has
reached the floor that the data's noise (standard deviation 0.01) sets, 0.0001.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import Param, dag

from airflow_provider_torchdist import TorchDistributorOperator, report


def train(lr: str | float, epochs: str | int = 5) -> dict[str, Any]:
    """Data-parallel linear regression (y = 3x + 1) over gloo; every rank trains on its own shard.

    An epoch is one pass over the rank's 64 samples in mini-batches of 8 (8 optimizer steps); the
    loss reported for it, and returned, is the mean of its mini-batch losses.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    lr, epochs = float(lr), int(epochs)  # rendered templates arrive as strings
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 1, generator=generator)
    y = 3 * x + 1 + 0.01 * torch.randn(64, 1, generator=generator)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        losses = []
        for xb, yb in zip(x.split(8), y.split(8), strict=True):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()  # gradients averaged across the ranks
            optimizer.step()
            losses.append(loss.item())
        epoch_loss = sum(losses) / len(losses)
        report(step=epoch, total_steps=epochs, loss=epoch_loss)
        print(f"epoch {epoch} loss {epoch_loss:.5f}")
    result = {
        "rank": rank,
        "world_size": world_size,
        "loss": epoch_loss,
        "learning_rate": lr,
        "epochs": epochs,
    }
    dist.destroy_process_group()
    return result


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["torchdist", "example"],
    doc_md=__doc__,
    params={
        "num_processes": Param(
            2,
            type="integer",
            minimum=1,
            maximum=4,
            title="Processes",
            description="Total number of training processes (ranks, the world size).",
        ),
        "local_mode": Param(
            False,
            type="boolean",
            title="Local mode",
            description="Run every rank on the Spark driver instead of in a barrier stage of Spark tasks.",
        ),
        "learning_rate": Param(
            0.1,
            type="number",
            exclusiveMinimum=0,
            maximum=1,
            title="Learning rate",
            description="SGD learning rate, in (0, 1].",
        ),
        "epochs": Param(
            5,
            type="integer",
            minimum=1,
            maximum=50,
            title="Epochs",
            description="Full passes over each rank's data.",
        ),
    },
)
def ui_triggered_training():
    TorchDistributorOperator(
        task_id="train",
        train_object=train,
        args=["{{ params.learning_rate }}"],
        kwargs={"epochs": "{{ params.epochs }}"},
        num_processes="{{ params.num_processes }}",
        local_mode="{{ params.local_mode }}",
        use_gpu=False,
    )


ui_triggered_training()
