"""A retraining DAG whose checkpoints live in object storage (tests/integration/test_checkpoint_store.py).

``train`` checkpoints 6 steps into a fixed ``s3://`` prefix through the connection ``ckpt_store``,
keeping the newest and the 3 best by ``val_loss``; ``evaluate`` loads the best one downstream.
Its bucket comes from ``TORCHDIST_TEST_CKPT_BUCKET``, the S3 server's address from the connection.

``checkpoint_store_lost`` saves asynchronously into a bucket of its own
(``TORCHDIST_TEST_LOST_BUCKET``) that goes away mid-run: the upload of its second checkpoint fails,
and so must the task.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import dag, task

from airflow_provider_torchdist import TorchDistributorOperator, load_checkpoint

#: val_loss after steps 1..6: the best three are steps 4, 2 and 3.
LOSSES = [0.9, 0.3, 0.5, 0.1, 0.7, 0.8]


def train_six_steps() -> dict:
    import torch

    from airflow_provider_torchdist import load_latest_checkpoint, save_checkpoint

    start, state = load_latest_checkpoint() or (0, None)
    for step in range(start, len(LOSSES)):
        save_checkpoint({"w": torch.tensor(float(step + 1))}, step + 1, metrics={"val_loss": LOSSES[step]})
    return {"start": start}


def train_then_lose_the_store() -> dict:
    """An asynchronous save, committed; then the store's bucket is deleted (the object store lost
    it), and the next asynchronous save's upload fails beside training."""
    import json

    import fsspec
    import torch

    from airflow_provider_torchdist import checkpoint_uri, save_checkpoint, wait_for_checkpoints

    save_checkpoint({"w": torch.ones(4)}, 1, asynchronous=True)
    wait_for_checkpoints()
    options = json.loads(os.environ["TORCHDIST_CHECKPOINT_STORAGE_OPTIONS"])
    fs, path = fsspec.core.url_to_fs(checkpoint_uri(), **options)
    fs.rm(path.split("/")[0], recursive=True)  # the bucket, and all in it
    save_checkpoint({"w": torch.full((4,), 2.0)}, 2, asynchronous=True)
    return {"returned": True}  # the run's end waits for the upload, which fails


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def checkpoint_store_lost():
    TorchDistributorOperator(
        task_id="train",
        train_object=train_then_lose_the_store,
        num_processes=1,
        local_mode=True,
        checkpoint_dir=f"s3://{os.environ.get('TORCHDIST_TEST_LOST_BUCKET', 'unset')}/lost",
        checkpoint_conn_id="ckpt_store",
    )


checkpoint_store_lost()


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def checkpoint_store_retrain():
    train = TorchDistributorOperator(
        task_id="train",
        train_object=train_six_steps,
        num_processes=1,
        local_mode=True,
        checkpoint_dir=f"s3://{os.environ.get('TORCHDIST_TEST_CKPT_BUCKET', 'unset')}/retrain",
        checkpoint_conn_id="ckpt_store",
        checkpoint_keep_last=1,
        checkpoint_keep_best=3,
        checkpoint_metric="val_loss",
    )

    @task
    def evaluate(ti=None) -> dict:
        state = load_checkpoint(ti, "best", task_id="train")
        return {"best_w": float(state["w"])}

    train >> evaluate()


checkpoint_store_retrain()
