"""Callbacks that report a framework Trainer's metrics with :func:`~airflow_provider_torchdist.report`.

Add one to the Trainer and change nothing else; global rank 0 reports its loss, learning rate and
epoch, with the step and the run's total steps::

    from airflow_provider_torchdist.callbacks import LightningReportCallback

    trainer = lightning.Trainer(..., callbacks=[LightningReportCallback()])

    from airflow_provider_torchdist.callbacks import TransformersReportCallback

    trainer = transformers.Trainer(..., callbacks=[TransformersReportCallback()])

:class:`LightningCheckpointCallback` and :class:`TransformersCheckpointCallback` keep the Trainer's
checkpoints in the task's checkpoint store (``checkpoint_dir``, local or ``s3://...``), under its
retention, listed in its XCom ``checkpoints``, and find the one a retry resumes from.

Neither framework is a dependency of this package: each class is made on first use, from its own
module, so this one imports without them, and using a class without its framework raises an
ImportError that names what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "LightningCheckpointCallback",
    "LightningReportCallback",
    "TransformersCheckpointCallback",
    "TransformersReportCallback",
]

#: name -> (module defining it, the framework's top-level package, what to install)
_LAZY = {
    "LightningCheckpointCallback": (
        "airflow_provider_torchdist.callbacks.lightning_checkpoint",
        "lightning",
        "PyTorch Lightning (pip install lightning)",
    ),
    "TransformersCheckpointCallback": (
        "airflow_provider_torchdist.callbacks.transformers_checkpoint",
        "transformers",
        "Hugging Face Transformers (pip install transformers)",
    ),
    "LightningReportCallback": (
        "airflow_provider_torchdist.callbacks.lightning_report",
        "lightning",
        "PyTorch Lightning (pip install lightning)",
    ),
    "TransformersReportCallback": (
        "airflow_provider_torchdist.callbacks.transformers_report",
        "transformers",
        "Hugging Face Transformers (pip install transformers)",
    ),
}

if TYPE_CHECKING:
    from airflow_provider_torchdist.callbacks.lightning_checkpoint import LightningCheckpointCallback
    from airflow_provider_torchdist.callbacks.lightning_report import LightningReportCallback
    from airflow_provider_torchdist.callbacks.transformers_checkpoint import TransformersCheckpointCallback
    from airflow_provider_torchdist.callbacks.transformers_report import TransformersReportCallback


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, framework, install = _LAZY[name]
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != framework:
            raise  # something else is missing: its own message says what
        raise ImportError(f"{name} needs {install}, which this Python cannot import: {exc}") from exc
    return getattr(found, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
