"""The run's checkpoint store, from the Airflow side: its credentials, its check at task start, and
what the ranks find in their environment.

``checkpoint_dir`` is a local path or any URI fsspec reaches (``s3://bucket/prefix``, ``gs://``,
``abfs://``, ``file:///``). By default the ranks reach a remote store with the executors' own
credentials (an instance role, workload identity). With ``checkpoint_conn_id`` the task resolves
that Airflow connection here, on the worker, into fsspec storage options:

- when an Airflow provider registers a filesystem for the scheme (the Amazon provider for ``s3``,
  Google for ``gs``, ...), the options are that filesystem's, as ``ObjectStoragePath`` would use;
- otherwise, for ``s3``: the login and password as the access key and secret, and the extra's
  ``endpoint_url``, ``region_name`` and ``aws_session_token``;
- for any scheme, the extra's ``storage_options`` (a dict) is laid over them.

The options reach the ranks as ``TORCHDIST_CHECKPOINT_STORAGE_OPTIONS`` in the run's ``spec.json``
(0600, in the 0700 staging directory), as ``rank_env`` does: never on a command line, never in the
environment Spark's UI shows, never in a file others can read. They are never logged.
"""

from __future__ import annotations

import json
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    SETTINGS_ENV,
    STORAGE_OPTIONS_ENV,
    Policy,
    Settings,
)
from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore, local_path
from airflow_provider_torchdist.spec import TrainingSpec
from airflow_provider_torchdist.submit.masking import mask_setting_secrets


def scheme_of(uri: str) -> str | None:
    """``"s3"`` for ``s3://bucket/x``; None for a local path or ``file://`` URI."""
    return None if local_path(uri) is not None else uri.partition("://")[0].lower()


def _s3_options(conn: Any, extra: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if conn.login:
        options["key"] = conn.login
    if conn.password:
        options["secret"] = conn.password
    if extra.get("aws_session_token"):
        options["token"] = extra["aws_session_token"]
    client = {k: extra[k] for k in ("endpoint_url", "region_name") if extra.get(k)}
    if client:
        options["client_kwargs"] = client
    return options


def _provider_options(scheme: str, conn_id: str) -> dict[str, Any] | None:
    """The storage options of the filesystem an Airflow provider registers for ``scheme`` (as
    ``ObjectStoragePath(..., conn_id=...)`` builds it), or None when no provider does."""
    try:
        from airflow.sdk.io.fs import get_fs, has_fs
    except ImportError:  # an Airflow without the SDK's io module: the built-in mapping
        return None
    if not has_fs(scheme):
        return None
    return dict(get_fs(scheme, conn_id).storage_options)


def storage_options(conn_id: str | None, uri: str) -> dict[str, Any]:
    """fsspec storage options for ``uri`` from the Airflow connection ``conn_id`` (see the module
    docstring); ``{}`` without one. Raises ``InvalidTrainingConfig`` naming the connection."""
    scheme = scheme_of(uri)
    if not conn_id or scheme is None:
        return {}
    from airflow.providers.common.compat.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # AirflowNotFoundException and the secrets backends' own errors
        raise InvalidTrainingConfig(f"checkpoint_conn_id {conn_id!r}: {exc}") from exc
    extra = conn.extra_dejson or {}
    provided = _provider_options(scheme, conn_id)
    if provided is not None:
        options = provided
    elif scheme in ("s3", "s3a"):
        options = _s3_options(conn, extra)
    else:
        options = {}
    laid_over = extra.get("storage_options") or {}
    if not isinstance(laid_over, dict):
        raise InvalidTrainingConfig(
            f"checkpoint_conn_id {conn_id!r}: the extra's storage_options must be a JSON object, got "
            f"{type(laid_over).__name__}"
        )
    options.update(laid_over)
    mask_setting_secrets(options)  # Airflow redacts the secret ones from every log line from here on
    try:
        json.dumps(options)
    except TypeError as exc:
        raise InvalidTrainingConfig(
            f"checkpoint_conn_id {conn_id!r} gives {scheme}:// storage options that cannot travel to the "
            f"ranks as JSON ({exc}). Put plain values in the extra's storage_options instead."
        ) from None
    return options


def check_checkpoint_store(uri: str, options: dict[str, Any], conn_id: str | None) -> None:
    """Preflight for a remote ``checkpoint_dir``: write and delete one small object there.

    Local directories are checked by ``preflight.check_checkpoint_dir``. Raises
    ``InvalidTrainingConfig`` saying what failed and with which credentials, before anything runs.
    """
    if scheme_of(uri) is None:
        return
    whose = (
        f"the connection {conn_id!r}" if conn_id else "this worker's own credentials (no checkpoint_conn_id)"
    )
    try:
        CheckpointStore(uri, options).probe()
    except ImportError as exc:
        raise InvalidTrainingConfig(
            f"checkpoint_dir {uri!r} needs the fsspec filesystem of its scheme: {exc}. Install it on "
            "the Airflow worker and on every executor (for s3://, airflow-provider-torchdist[s3])."
        ) from exc
    except Exception as exc:  # each filesystem raises its own: say it, whatever it is
        raise InvalidTrainingConfig(
            f"checkpoint_dir {uri!r} is not writable with {whose}: writing and deleting a probe object "
            f"failed ({type(exc).__name__}: {exc}). Check the bucket and prefix, and that the "
            "credentials may put and delete objects there (the executors need the same)."
        ) from exc


def checkpoint_rank_env(spec: TrainingSpec) -> dict[str, str]:
    """What every rank finds about checkpoints: the directory, the run's checkpoint settings
    (``resume_from``, retention) and, with ``checkpoint_conn_id``, the storage options; checked
    (remote stores probed) first. ``{}`` when the run has no checkpoint directory."""
    if not spec.checkpoint_dir:
        return {}
    uri = str(spec.checkpoint_dir)
    options = storage_options(spec.checkpoint_conn_id, uri)
    check_checkpoint_store(uri, options, spec.checkpoint_conn_id)
    settings = Settings(
        resume_from=spec.resume_from,
        policy=Policy(
            keep_last=spec.checkpoint_keep_last,
            keep_best=spec.checkpoint_keep_best,
            metric=spec.checkpoint_metric,
            mode=spec.checkpoint_mode,
        ),
    )
    env = {CHECKPOINT_ENV: uri, SETTINGS_ENV: settings.to_json()}
    if options:
        env[STORAGE_OPTIONS_ENV] = json.dumps(options)
    return env
