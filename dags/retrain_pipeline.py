"""A scheduled retraining pipeline: prepare data, train on Spark, evaluate, promote only if better.

    prepare_data >> train >> evaluate >> choose >> [promote, skip_promotion]

- ``prepare_data`` writes a synthetic regression data set (train and validation splits) to a
  tensor file and returns its path.
- ``train`` runs :func:`train` on 2 ranks (DDP over gloo) with :class:`TorchDistributorOperator`;
  rank 0's ``{"state_dict", "loss", ...}`` comes back through XCom as an envelope, and the loss
  history that :func:`report` sent goes to the XCom key ``metrics`` (as it grows, and whole at the
  end). It declares the trained model as an asset, ``torchdist://models/retrain``: its success
  triggers the ``evaluate_model`` DAG, which reads the run's final metrics from the asset event.
- ``evaluate`` decodes the candidate with :func:`load_output` and scores it, and the current
  model, on the same validation split.
- ``choose`` promotes the candidate only when it beats the current model; the first run always
  promotes, as there is no current model yet.

With an ``mlflow`` connection ``mlflow_default`` (and ``pip install "airflow-provider-torchdist[mlflow]"``),
``train`` is also an MLflow run (metrics, params, tags; its ``state_dict`` logged as the run's model)
and ``promote`` registers that model as a new version of ``retrain`` (docs/tracking.md).

Where files go: ``$TORCHDIST_DATA_DIR`` (default ``<tmp>/torchdist_retrain/data``) and
``$TORCHDIST_MODELS_DIR`` (default ``<tmp>/torchdist_retrain/models``, the current model is
``current.pt`` there), read when the tasks run.
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import Asset, dag, get_current_context, task

from airflow_provider_torchdist import TorchDistributorOperator, load_output, report

FEATURES = 4
CURRENT_MODEL = "current.pt"
#: The trained model: each successful ``train`` emits an event for it (``dags/evaluate_model.py``).
MODEL = Asset("torchdist://models/retrain")


def mlflow_conn_id(conn_id: str = "mlflow_default") -> str | None:
    """``conn_id`` when it is an ``mlflow`` connection and the MLflow client is installed, else None
    (the pipeline then trains untracked)."""
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        return None
    try:
        from airflow.sdk import BaseHook

        return conn_id if BaseHook.get_connection(conn_id).conn_type == "mlflow" else None
    except Exception:  # no such connection
        return None


MLFLOW_CONN_ID = mlflow_conn_id()


def data_dir() -> Path:
    """Where ``prepare_data`` writes data sets."""
    default = Path(tempfile.gettempdir()) / "torchdist_retrain" / "data"
    return Path(os.environ.get("TORCHDIST_DATA_DIR", default))


def models_dir() -> Path:
    """Where the current model and the candidates live."""
    default = Path(tempfile.gettempdir()) / "torchdist_retrain" / "models"
    return Path(os.environ.get("TORCHDIST_MODELS_DIR", default))


def safe_name(run_id: str) -> str:
    """A run id as a file name (run ids hold ``:`` and ``+``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


def make_model():
    """The model every task agrees on: a linear regression on ``FEATURES`` inputs."""
    import torch

    return torch.nn.Linear(FEATURES, 1)


def train(data_path: str, lr: float = 0.1, epochs: int = 60) -> dict[str, Any]:
    """Runs on every rank: full-batch DDP training on this rank's shard of the training split.

    Returns (rank 0's value reaches Airflow) the final global loss and the trained state_dict.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = torch.load(data_path)
    x, y = data["x_train"][rank::world_size], data["y_train"][rank::world_size]
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world_size
        if epoch % 10 == 0 or epoch == epochs - 1:
            # Only rank 0's reports are kept; total_steps lets a progress view show how far along it is.
            report(step=epoch, total_steps=epochs, loss=global_loss)
            print(f"epoch {epoch} shard loss {loss.item():.5f}")
    result = {
        "rank": rank,
        "world_size": world_size,
        "loss": global_loss.item(),
        "state_dict": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
    }
    dist.destroy_process_group()
    return result


def validation_loss(state_dict: dict[str, Any], data: dict[str, Any]) -> float:
    """Mean squared error of a model with ``state_dict`` on the validation split."""
    import torch

    model = make_model()
    model.load_state_dict(state_dict)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(data["x_val"]), data["y_val"]).item()


@dag(
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["torchdist", "example"],
    doc_md=__doc__,
)
def retrain_pipeline():
    @task
    def prepare_data(samples: int = 512) -> str:
        """A fresh synthetic data set, y = x @ w + 0.5 + noise, split 80/20; returns its path."""
        import torch

        run_id = get_current_context()["run_id"]
        generator = torch.Generator().manual_seed(zlib.crc32(run_id.encode()))
        true_w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
        x = torch.randn(samples, FEATURES, generator=generator)
        y = x @ true_w + 0.5 + 0.05 * torch.randn(samples, 1, generator=generator)
        split = int(samples * 0.8)
        path = data_dir() / f"{safe_name(run_id)}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"x_train": x[:split], "y_train": y[:split], "x_val": x[split:], "y_val": y[split:]}, path)
        print(f"wrote {samples} samples to {path}")
        return str(path)

    data_path = prepare_data()

    trained = TorchDistributorOperator(
        task_id="train",
        train_object=train,
        args=[data_path],
        kwargs={"lr": 0.1, "epochs": 60},
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        outlets=[MODEL],  # the event's extra: final metrics, output type and size, world size, duration
        mlflow_conn_id=MLFLOW_CONN_ID,  # None: no tracking
        mlflow_log_model=MLFLOW_CONN_ID is not None,  # rank 0's state_dict, as the run's model
    )

    @task
    def evaluate(value: Any, data_path: str, dag_run: Any = None) -> dict[str, Any]:
        """Score the candidate and the current model on this run's validation split."""
        import torch

        # Rank 0's dict, state_dict tensors included; only if signed for this run's train task.
        expect = {"dag_id": dag_run.dag_id, "run_id": dag_run.run_id, "task_id": "train"}
        result = load_output(value, expect=expect)
        history = get_current_context()["ti"].xcom_pull(task_ids="train", key="metrics")
        reported_loss = history[-1]["loss"]
        if abs(reported_loss - result["loss"]) > 1e-6:
            raise ValueError(f"report()'s last loss {reported_loss} != the returned loss {result['loss']}")

        data = torch.load(data_path)
        candidate = models_dir() / "candidates" / f"{safe_name(get_current_context()['run_id'])}.pt"
        candidate.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result["state_dict"], candidate)
        current = models_dir() / CURRENT_MODEL
        summary = {
            "candidate": str(candidate),
            "train_loss": result["loss"],
            "reported_loss": reported_loss,
            "reports": len(history),
            "val_loss": validation_loss(result["state_dict"], data),
            "current_val_loss": validation_loss(torch.load(current), data) if current.exists() else None,
        }
        print(f"EVALUATION {summary}")
        return summary

    evaluation = evaluate(trained.output, data_path)

    @task.branch
    def choose(evaluation: dict[str, Any]) -> str:
        """Promote when there is no current model, or when the candidate's loss is lower."""
        current = evaluation["current_val_loss"]
        if current is None or evaluation["val_loss"] < current:
            return "promote"
        return "skip_promotion"

    @task
    def promote(evaluation: dict[str, Any]) -> str:
        """Make the candidate the current model (an atomic rename, so readers never see half a file)."""
        target = models_dir() / CURRENT_MODEL
        staging = target.with_suffix(".tmp")
        staging.write_bytes(Path(evaluation["candidate"]).read_bytes())
        os.replace(staging, target)
        print(f"promoted {evaluation['candidate']} (val loss {evaluation['val_loss']:.6f}) to {target}")
        if MLFLOW_CONN_ID is not None:  # and a new version of the registered model, from train's run
            from airflow_provider_torchdist.operators.tracking.models import register_model

            uri = get_current_context()["ti"].xcom_pull(task_ids="train", key="mlflow_model_uri")
            if uri:
                print(f"registered {register_model(MLFLOW_CONN_ID, uri, 'retrain')}")
        return str(target)

    @task
    def skip_promotion(evaluation: dict[str, Any]) -> None:
        """Keep the current model."""
        print(
            f"kept the current model: val loss {evaluation['current_val_loss']:.6f} <= "
            f"candidate's {evaluation['val_loss']:.6f}"
        )

    choose(evaluation) >> [promote(evaluation), skip_promotion(evaluation)]


retrain_pipeline()
