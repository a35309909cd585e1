"""The checkpoint settings' checks: ``checkpoint_dir`` (a local path or an fsspec URI),
``resume_from``, ``checkpoint_mode``, and the retention settings together."""

from __future__ import annotations

from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.submit.validation import checkpoint_dir_path

CHECKPOINT_MODES = ("min", "max")


def _fsspec_knows(scheme: str) -> bool:
    import fsspec

    return scheme in fsspec.available_protocols()


def checkpoint_dir_uri(value: Any) -> str:
    """``checkpoint_dir`` checked: an absolute path or ``file:///`` URI, or a URI of a store fsspec
    knows (``s3://bucket/prefix``). Returns it as given; its store is checked when the task starts."""
    if isinstance(value, str) and "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme.lower() != "file":
            if not _fsspec_knows(scheme.lower()) or not rest.strip("/"):
                raise InvalidTrainingConfig(
                    f"checkpoint_dir {value!r} is not a path or a URI of a store fsspec knows (such as "
                    "s3://bucket/prefix, gs://bucket/prefix, abfs://container/prefix, file:///abs/path)."
                )
            return value
    checkpoint_dir_path(value)
    return value


def check_resume_from(value: Any, name: str) -> str | None:
    """``"latest"``, a checkpoint's URI (``.../step-000000010-<run>``), or None."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise InvalidTrainingConfig(f"{name} must be 'latest', a checkpoint's URI or None, got {value!r}")
    if value == "latest":
        return value
    from airflow_provider_torchdist.spark.node.checkpoint_manifest import STEP_DIR

    if not STEP_DIR.match(value.rstrip("/").rsplit("/", 1)[-1]):
        raise InvalidTrainingConfig(
            f"{name}={value!r} is neither 'latest' nor a checkpoint's URI: a checkpoint is a "
            "step-<9 digits>-<run> prefix, as the uri of an entry of the checkpoints XCom names it "
            "(such as s3://bucket/ckpt/step-000000040-3f2a9c1b0d4e)."
        )
    checkpoint_dir_uri(value)
    return value


def check_checkpoint_mode(value: Any, name: str) -> str:
    if value not in CHECKPOINT_MODES:
        raise InvalidTrainingConfig(f"{name} must be 'min' or 'max', got {value!r}")
    return value


def check_retention(settings: dict[str, Any]) -> None:
    """``checkpoint_keep_best`` needs ``checkpoint_metric``; something must be kept."""
    if settings["checkpoint_keep_best"] and not settings["checkpoint_metric"]:
        raise InvalidTrainingConfig(
            f"checkpoint_keep_best={settings['checkpoint_keep_best']} needs checkpoint_metric: the name "
            "of a metric the training passes to save_checkpoint(..., metrics={...}), such as 'val_loss'."
        )
    if settings["checkpoint_keep_last"] == 0 and settings["checkpoint_keep_best"] == 0:
        raise InvalidTrainingConfig(
            "checkpoint_keep_last=0 with checkpoint_keep_best=0 would delete every checkpoint as it is "
            "written: keep at least one (checkpoint_keep_last=1)."
        )
