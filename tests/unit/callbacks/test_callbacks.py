"""The framework callbacks: what a real Lightning / Hugging Face Trainer makes them report, on
which rank, and the package without the frameworks."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from airflow_provider_torchdist.callbacks.scalars import known_total, scalar_metrics


def _metric_names(record: dict[str, Any]) -> set[str]:
    return set(record) - {"rank", "step", "time", "total_steps"}


# -- what is a metric --------------------------------------------------------------------------------


def test_only_numbers_and_one_element_tensors_are_metrics() -> None:
    values = {
        "loss": torch.tensor(0.5),
        "lr": 0.01,
        "epoch": 1,
        "flag": True,
        "name": "x",
        "weights": torch.ones(3),
        "time": 1.0,
        "total_steps": 9,
    }
    assert scalar_metrics(values) == {"loss": 0.5, "lr": 0.01, "epoch": 1}


@pytest.mark.parametrize(
    ("value", "total"), [(12, 12), (12.0, 12), (float("inf"), None), (0, None), (-1, None)]
)
def test_a_total_is_kept_only_when_the_framework_knows_it(value: float, total: int | None) -> None:
    assert known_total(value) == total


# -- Lightning ---------------------------------------------------------------------------------------


def _lightning_fit(callback: Any, **trainer_kwargs: Any) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8))


def test_lightning_reports_every_logging_step_and_the_last(sent_metrics: list[dict[str, Any]]) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    _lightning_fit(LightningReportCallback(), max_epochs=3, log_every_n_steps=5)  # 4 batches an epoch
    assert [(r["step"], r["total_steps"], r["epoch"]) for r in sent_metrics] == [
        (5, 12, 1),
        (10, 12, 2),
        (12, 12, 2),
    ]
    for record in sent_metrics:
        assert _metric_names(record) == {"loss", "learning_rate", "epoch", "train_loss"}
        assert record["learning_rate"] == 0.05 and record["loss"] == pytest.approx(record["train_loss"])


def test_lightning_reports_once_a_step_under_gradient_accumulation(
    sent_metrics: list[dict[str, Any]],
) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    _lightning_fit(LightningReportCallback(every_n_steps=1), max_epochs=2, accumulate_grad_batches=2)
    assert [(r["step"], r["total_steps"]) for r in sent_metrics] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_lightning_without_an_end_reports_no_total(sent_metrics: list[dict[str, Any]]) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    trainer = SimpleNamespace(
        is_global_zero=True,
        global_step=3,
        log_every_n_steps=1,
        estimated_stepping_batches=float("inf"),
        current_epoch=0,
        optimizers=[],
        callback_metrics={},
    )
    callback = LightningReportCallback()
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(2.0)}, None, 0)  # type: ignore[arg-type]
    (record,) = sent_metrics
    assert "total_steps" not in record and (record["step"], record["loss"], record["epoch"]) == (3, 2.0, 0)


@pytest.mark.parametrize(("all_ranks", "reports"), [(False, 0), (True, 1)])
def test_lightning_on_another_rank_reports_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, sent_metrics: list[dict[str, Any]], all_ranks: bool, reports: int
) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    monkeypatch.setenv("RANK", "1")
    trainer = SimpleNamespace(
        is_global_zero=False,
        global_step=1,
        log_every_n_steps=1,
        estimated_stepping_batches=2,
        current_epoch=0,
        optimizers=[],
        callback_metrics={},
    )
    callback = LightningReportCallback(all_ranks=all_ranks)
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    callback.on_train_batch_end(trainer, None, torch.tensor(1.0), None, 0)  # type: ignore[arg-type]
    assert [r["rank"] for r in sent_metrics] == [1] * reports


@pytest.mark.parametrize("every", [0, -1, True, 1.5])
def test_lightning_refuses_a_bad_interval(every: Any) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    with pytest.raises(ValueError, match="every_n_steps must be a positive int or None"):
        LightningReportCallback(every_n_steps=every)


# -- Hugging Face ------------------------------------------------------------------------------------


def test_transformers_trainer_reports_each_log(
    sent_metrics: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import accelerate  # noqa: F401  (the [test] extra has both: missing fails, not skips)
    import transformers

    from airflow_provider_torchdist.callbacks import TransformersReportCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_train_epochs=2,
        logging_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=data,
        callbacks=[TransformersReportCallback()],
    )
    trainer.train()
    steps = [r for r in sent_metrics if "loss" in r]
    assert [(r["step"], r["total_steps"]) for r in steps] == [(2, 8), (4, 8), (6, 8), (8, 8)]
    assert {"loss", "learning_rate", "epoch"} <= _metric_names(steps[0])
    assert [r["epoch"] for r in steps] == [0.5, 1.0, 1.5, 2.0]
    summary = sent_metrics[-1]  # the Trainer's closing log: its runtime and mean loss
    assert summary["step"] == 8 and "train_loss" in summary and "train_runtime" in summary


def _hf_state(**fields: Any) -> Any:
    return SimpleNamespace(**{"is_world_process_zero": True, "global_step": 5, "max_steps": 10, **fields})


def test_transformers_leaves_out_what_is_not_a_number(sent_metrics: list[dict[str, Any]]) -> None:
    import transformers  # noqa: F401  (in the [test] extra)

    from airflow_provider_torchdist.callbacks import TransformersReportCallback

    callback = TransformersReportCallback()
    callback.on_log(None, _hf_state(max_steps=0), None, logs={"loss": 0.5, "note": "x"})  # type: ignore[arg-type]
    callback.on_log(None, _hf_state(), None, logs={"note": "x"})  # type: ignore[arg-type]  # nothing to report
    callback.on_log(None, _hf_state(), None, logs=None)  # type: ignore[arg-type]
    assert [{k: r[k] for k in r if k != "time"} for r in sent_metrics] == [
        {"rank": 0, "step": 5, "loss": 0.5}
    ]


@pytest.mark.parametrize(("all_ranks", "reports"), [(False, 0), (True, 1)])
def test_transformers_on_another_rank_reports_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, sent_metrics: list[dict[str, Any]], all_ranks: bool, reports: int
) -> None:
    import transformers  # noqa: F401  (in the [test] extra)

    from airflow_provider_torchdist.callbacks import TransformersReportCallback

    monkeypatch.setenv("RANK", "1")
    callback = TransformersReportCallback(all_ranks=all_ranks)
    callback.on_log(None, _hf_state(is_world_process_zero=False), None, logs={"loss": 1.0})  # type: ignore[arg-type]
    assert [(r["rank"], r["total_steps"]) for r in sent_metrics] == [(1, 10)] * reports


# -- without the frameworks --------------------------------------------------------------------------

WITHOUT_FRAMEWORKS = """
import sys
sys.modules["lightning"] = None      # any import of them now raises ImportError
sys.modules["transformers"] = None
import airflow_provider_torchdist.callbacks as callbacks
from airflow_provider_torchdist import report
for name in ("LightningReportCallback", "TransformersReportCallback"):
    try:
        getattr(callbacks, name)
    except ImportError as exc:
        print(name, "->", exc)
try:
    from airflow_provider_torchdist.callbacks import LightningReportCallback
except ImportError as exc:
    print("from-import ->", type(exc).__name__)
try:
    callbacks.NoSuchCallback
except AttributeError as exc:
    print("other ->", exc)
"""


def test_the_package_imports_without_the_frameworks_and_names_the_missing_one() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_FRAMEWORKS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "LightningReportCallback -> LightningReportCallback needs PyTorch Lightning (pip install lightning)"
    )
    assert lines[1].startswith(
        "TransformersReportCallback -> TransformersReportCallback needs Hugging Face Transformers"
        " (pip install transformers)"
    )
    assert lines[2] == "from-import -> ImportError"
    assert (
        lines[3] == "other -> module 'airflow_provider_torchdist.callbacks' has no attribute 'NoSuchCallback'"
    )


# -- a graceful stop -----------------------------------------------------------------------------------


@pytest.fixture
def stop_after(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The run is stopped once the callbacks have asked ``stop_requested`` n times (as if the stop
    came during that step); no signal is involved here (``tests/unit/spark/node/test_stop.py``)."""
    from airflow_provider_torchdist.spark.node import stop

    def arm(n: int) -> list[int]:
        asked = [0]

        def stop_requested(all_ranks: bool = False) -> bool:
            asked[0] += 1
            return asked[0] >= n

        monkeypatch.setattr(stop, "stop_requested", stop_requested)
        return asked

    return arm


def test_lightning_saves_a_checkpoint_and_ends_fit_when_the_run_is_stopped(
    sent_metrics: list[dict[str, Any]], stop_after: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchdist.callbacks import LightningReportCallback

    monkeypatch.setenv("TORCHDIST_CHECKPOINT_DIR", str(tmp_path))
    asked = stop_after(3)
    _lightning_fit(LightningReportCallback(), max_epochs=3)  # 12 batches, had it not been stopped
    assert asked[0] == 3  # fit ended after the third batch
    saved = torch.load(tmp_path / "stopped.ckpt", weights_only=False)
    assert saved["global_step"] == 3


def test_transformers_saves_a_checkpoint_and_ends_train_when_the_run_is_stopped(
    sent_metrics: list[dict[str, Any]], stop_after: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from airflow_provider_torchdist.callbacks import TransformersReportCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_train_epochs=2,
        report_to=[],
        save_strategy="no",  # nothing saved but what the stop asks for
        use_cpu=True,
        disable_tqdm=True,
    )
    asked = stop_after(2)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in ids],
        callbacks=[TransformersReportCallback()],
    )
    trainer.train()
    assert asked[0] == 2 and trainer.state.global_step == 2  # of 8
    assert (tmp_path / "checkpoint-2").is_dir()
