"""Which checkpoint a run resumes, which ones retention keeps, and their order: pure choices over
manifests (``spark/node/checkpoint_manifest.py``)."""

from __future__ import annotations

import json

import pytest

from airflow_provider_torchdist.spark.node.checkpoint_manifest import (
    RUN_ENV,
    SETTINGS_ENV,
    Manifest,
    Policy,
    Settings,
    best_first,
    choose_resume,
    clean_metrics,
    run_env,
    step_dir,
    to_keep,
)

RUN_1 = {"dag_id": "retrain", "run_id": "scheduled__1", "task_id": "train", "map_index": -1}
RUN_2 = {**RUN_1, "run_id": "scheduled__2"}


def m(step: int, t: float, run: dict | None = RUN_1, finished: bool = False, **metrics: float) -> Manifest:
    return Manifest(step=step, time=t, metrics=metrics, run=run, finished=finished)


def test_a_new_dag_run_starts_fresh_over_a_finished_runs_checkpoints_and_says_how_to_resume() -> None:
    """The issue's first case: run 1 finished at step 4; run 2 with the same checkpoint_dir."""
    chosen, why = choose_resume(
        [m(2, 1.0, finished=True), m(4, 2.0, finished=True)], Settings(run=RUN_2), "/ck"
    )
    assert chosen is None
    assert why.startswith("starting fresh (step 0)")
    assert "'scheduled__1'" in why and "which finished" in why and "resume_from='latest'" in why


def test_a_retry_of_the_same_dag_run_resumes_its_own_newest() -> None:
    manifests = [m(4, 1.0, run=RUN_2), m(6, 2.0), m(8, 3.0), m(10, 4.0, run=RUN_2)]
    chosen, why = choose_resume(manifests, Settings(run=RUN_1, try_number=2), "/ck")
    assert chosen is not None and chosen.step == 8
    assert "resuming from step 8" in why and "earlier try" in why


def test_resume_from_latest_takes_the_newest_whoever_wrote_it() -> None:
    manifests = [m(8, 1.0), m(3, 5.0, run=RUN_2)]
    chosen, why = choose_resume(
        manifests, Settings(run={**RUN_1, "run_id": "r3"}, resume_from="latest"), "/ck"
    )
    assert chosen is not None and chosen.step == 3 and "resume_from='latest'" in why
    assert choose_resume([], Settings(resume_from="latest"), "/ck")[0] is None


def test_an_empty_store_starts_fresh_and_says_so() -> None:
    assert choose_resume([], Settings(run=RUN_1), "s3://b/ck") == (
        None,
        "starting fresh: no committed checkpoint in s3://b/ck",
    )


def test_retention_keeps_the_newest_and_the_best_by_the_metric() -> None:
    losses = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.1, 50: 0.7, 60: 0.8}
    manifests = [m(step, float(step), val_loss=loss) for step, loss in losses.items()]
    policy = Policy(keep_last=1, keep_best=3, metric="val_loss", mode="min")
    assert sorted(x.step for x in to_keep(manifests, policy)) == [20, 30, 40, 60]
    ordered = best_first(to_keep(manifests, policy), policy)
    assert [x.step for x in ordered] == [40, 20, 30, 60]
    maximize = Policy(keep_last=0, keep_best=2, metric="val_loss", mode="max")
    assert [x.step for x in best_first(to_keep(manifests, maximize), maximize)] == [10, 60]


def test_a_checkpoint_without_the_metric_is_never_among_the_best() -> None:
    manifests = [m(1, 1.0, val_loss=0.5), m(2, 2.0), m(3, 3.0, val_loss=0.9)]
    policy = Policy(keep_last=0, keep_best=2, metric="val_loss")
    assert [x.step for x in best_first(to_keep(manifests, policy), policy)] == [1, 3]
    assert [x.step for x in best_first(manifests, Policy())] == [3, 2, 1]  # no metric: newest first


def test_manifest_and_settings_round_trip_through_json_and_the_environment() -> None:
    manifest = Manifest(step=7, time=12.5, metrics={"val_loss": 0.25}, run=RUN_1, try_number=2)
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ValueError, match="torchdist-checkpoint/1"):
        Manifest.from_json(json.dumps({"step": 1, "time": 0}))
    env = {
        RUN_ENV: run_env("retrain", "scheduled__1", "train", -1, 3),
        SETTINGS_ENV: Settings(resume_from="latest", policy=Policy(keep_best=3, metric="val_loss")).to_json(),
    }
    settings = Settings.from_env(env)
    assert settings.run == RUN_1 and settings.try_number == 3 and settings.resume_from == "latest"
    assert settings.policy == Policy(keep_best=3, metric="val_loss")
    assert Settings.from_env({}) == Settings()


def test_two_dag_runs_never_share_a_step_prefix() -> None:
    assert step_dir(10, RUN_1) != step_dir(10, RUN_2)
    assert step_dir(10, None) == "step-000000010-local"


def test_metrics_must_be_finite_numbers() -> None:
    assert clean_metrics({"val_loss": 1, "acc": 0.5}) == {"val_loss": 1.0, "acc": 0.5}
    with pytest.raises(TypeError, match="metrics\\['val_loss'\\] must be a number"):
        clean_metrics({"val_loss": "low"})
    with pytest.raises(ValueError, match="finite"):
        clean_metrics({"val_loss": float("nan")})


def test_one_runs_newest_is_its_highest_step_whatever_its_hosts_clocks_say() -> None:
    """Try 1 ran on a host whose clock is ahead: its step 10 looks newer than try 2's step 12."""
    manifests = [m(10, 100.0), m(12, 50.0)]
    chosen, _ = choose_resume(manifests, Settings(run=RUN_1), "/ck")
    assert chosen is not None and chosen.step == 12
    assert [x.step for x in to_keep(manifests, Policy(keep_last=1))] == [12]
