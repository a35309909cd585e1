"""A remote ``checkpoint_dir`` from the Airflow side, against moto's S3 server (a separate process,
reached over HTTP): the connection's credentials reach the ranks only through the 0600
``spec.json``, a store that cannot be written fails the task before anything runs, and a bad
``checkpoint_dir`` or ``resume_from`` fails the DAG import."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    CHECKPOINT_ENV,
    SETTINGS_ENV,
    STORAGE_OPTIONS_ENV,
)
from airflow_provider_torchdist.submit.checkpoint_storage import storage_options
from tests.object_store import KEY, SECRET, S3Server

CONN_ID = "ckpt_store"


def _train() -> int:
    return 1


@pytest.fixture
def s3_conn(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The ``aws`` connection ``ckpt_store`` (from the environment, as a secrets backend gives it)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", s3_server.connection_uri_env())
    return s3_server


def test_an_aws_connection_becomes_s3fs_options(s3_conn: S3Server) -> None:
    assert storage_options(CONN_ID, "s3://bucket/ckpt") == {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": s3_conn.endpoint, "region_name": "us-east-1"},
    }
    assert storage_options(CONN_ID, "/local/ckpt") == {}  # a local directory needs none
    assert storage_options(None, "s3://bucket/ckpt") == {}  # the executors' own credentials


def test_the_credentials_reach_the_ranks_only_in_the_private_spec(s3_conn: S3Server, tmp_path: Path) -> None:
    """Staged for real (no spark-submit): the secret is in the 0600 spec.json, in the ranks'
    environment, and nowhere in spark-submit's command, environment or properties file."""
    uri = f"s3://{s3_conn.bucket()}/ckpt"
    staging = tmp_path / "staging"
    staging.mkdir()
    hook = TorchDistributorHook(
        num_processes=1,
        local_mode=True,
        checkpoint_dir=uri,
        checkpoint_conn_id=CONN_ID,
        checkpoint_keep_best=3,
        checkpoint_metric="val_loss",
        staging_dir=str(staging),
    )
    staged = hook._prepare(_train, None, None)
    try:
        spec_text = staged.spec_path.read_text()
        assert stat.S_IMODE(staged.spec_path.stat().st_mode) == 0o600
        rank_env = json.loads(spec_text)["rank_env"]
        assert rank_env[CHECKPOINT_ENV] == uri
        assert json.loads(rank_env[STORAGE_OPTIONS_ENV])["secret"] == SECRET
        assert json.loads(rank_env[SETTINGS_ENV])["policy"]["metric"] == "val_loss"
        plan = hook.plan
        assert plan is not None
        public = json.dumps([plan.application_args, plan.env, plan.properties], default=str)
        props = "".join(p.read_text() for p in staged.dir.glob("*.properties"))
        for text in (public, props):
            assert SECRET not in text and KEY not in text
    finally:
        staged.cleanup()


def test_a_store_that_cannot_be_written_fails_before_anything_is_staged(
    s3_conn: S3Server, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    hook = TorchDistributorHook(
        num_processes=1,
        local_mode=True,
        checkpoint_dir="s3://no-such-bucket-anywhere/ckpt",
        checkpoint_conn_id=CONN_ID,
        staging_dir=str(staging),
    )
    with pytest.raises(InvalidTrainingConfig) as raised:
        hook.run(_train)
    message = str(raised.value)
    assert "checkpoint_dir 's3://no-such-bucket-anywhere/ckpt' is not writable with the connection" in message
    assert "probe object" in message and SECRET not in message
    assert hook.plan is None and list(staging.iterdir()) == []


def test_a_missing_connection_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidTrainingConfig, match="checkpoint_conn_id 'nope'"):
        storage_options("nope", "s3://bucket/ckpt")
