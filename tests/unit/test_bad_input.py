"""The bad-input table (docs/bad-inputs.md), row by row: each bad input gets its clear error, at the
earliest moment it can be known, and before spark-submit ever starts.

Row ids match the table's "test" column. Run-time rows live in tests/integration (named there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist.errors import (
    InvalidTrainingConfig,
    PayloadNotPicklable,
    SparkSubmitFailed,
    TorchDistributorError,
)
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.outputs.results import OutputSignatureError, load_output


def _train(x: int = 1) -> int:
    return x


def _refused_before_submit(hook: TorchDistributorHook, staging: Path, started: list[str]) -> None:
    assert started == [] and hook.plan is None  # nothing planned, spark-submit never ran
    assert not staging.exists() or list(staging.iterdir()) == []  # nothing staged, or staged and removed


@pytest.fixture
def made_hooks(monkeypatch: pytest.MonkeyPatch) -> list[TorchDistributorHook]:
    """Every hook an operator makes (through ``make_hook``)."""
    hooks: list[TorchDistributorHook] = []
    real = TorchDistributorOperator.make_hook

    def make_hook(self: TorchDistributorOperator, context: object = None) -> TorchDistributorHook:
        hooks.append(real(self, context))
        return hooks[-1]

    monkeypatch.setattr(TorchDistributorOperator, "make_hook", make_hook)
    return hooks


# -- DAG parse time: the operator's constructor ---------------------------------------------------

PARSE_TIME = [
    pytest.param(
        {"num_processes": "abc"}, r"num_processes must be an integer >= 1, got 'abc'", id="num_processes-abc"
    ),
    pytest.param({"num_processes": 0}, r"num_processes must be an integer >= 1, got 0", id="num_processes-0"),
    pytest.param(
        {"num_processes": 2.5}, r"num_processes must be an integer >= 1, got 2\.5", id="num_processes-2.5"
    ),
    pytest.param(
        {"local_mode": "maybe"}, r"local_mode must be True or False, got 'maybe'", id="local_mode-maybe"
    ),
    pytest.param({"use_gpu": 1}, r"use_gpu must be True or False, got 1", id="use_gpu-1"),
    pytest.param({"args": "0.1"}, r"args must be a list, got str: '0\.1'", id="args-str"),
    pytest.param({"args": 5}, r"args must be a list, got int", id="args-int"),
    pytest.param({"kwargs": [("lr", 0.1)]}, r"kwargs must be a dict, got list", id="kwargs-list"),
    pytest.param({"kwargs": {1: 2}}, r"kwargs keys must be strings", id="kwargs-int-keys"),
    pytest.param(
        {"train_object": 42},
        r"train_object must be a callable or the path of a \.py training script, got int: 42",
        id="train_object-int",
    ),
    pytest.param(
        {"num_processes": 3, "nproc_per_node": 2},
        r"num_processes=3 is not divisible by nproc_per_node=2.*Use e\.g\. num_processes=2",
        id="nproc_per_node-not-dividing",
    ),
    pytest.param(
        {"max_restarts": -1}, r"max_restarts must be an integer >= 0, got -1", id="max_restarts-negative"
    ),
    pytest.param(
        {"spark_submit_kwargs": {"deploy_mode": "cluster"}},
        r"deploy_mode='cluster' is not supported.*pass deploy_mode='client'",
        id="deploy_mode-cluster",
    ),
    pytest.param(
        {"conf": {"spark.ssl.enabled": "true"}},
        r"spark\.ssl\.enabled=true, but torch\.distributed traffic.*pass allow_unencrypted=True",
        id="ssl-without-allow_unencrypted",
    ),
    pytest.param(
        {"num_processes": 100_001},
        r"num_processes=100001 is more than 100000: more ranks than any Spark cluster could schedule",
        id="num_processes-absurd",
    ),
    pytest.param(
        {"num_processes": 2050, "nproc_per_node": 1025},
        r"nproc_per_node=1025 is more than 1024: more ranks than one machine could run",
        id="nproc_per_node-absurd",
    ),
    pytest.param(
        {"num_processes": 1025, "local_mode": True},
        r"num_processes=1025 is more than 1024: local_mode=True runs every rank on the Spark driver",
        id="num_processes-absurd-local_mode",
    ),
    pytest.param(
        {"num_processes": "\uff12"},  # FULLWIDTH DIGIT TWO: str.isdigit() and int() accept it
        r"num_processes must be an integer >= 1 written with ASCII digits 0-9, got '\uff12'",
        id="num_processes-fullwidth-digit",
    ),
    pytest.param(
        {"max_restarts": "\u0663"},  # ARABIC-INDIC DIGIT THREE
        r"max_restarts must be an integer >= 0 written with ASCII digits 0-9, got '\u0663'",
        id="max_restarts-arabic-indic-digit",
    ),
    pytest.param(
        {"rendezvous_timeout": float("nan")},
        r"rendezvous_timeout must be a whole number of seconds >= 1, got nan",
        id="rendezvous_timeout-nan",
    ),
    pytest.param(
        {"rendezvous_timeout": float("inf")},
        r"rendezvous_timeout must be a whole number of seconds >= 1, got inf",
        id="rendezvous_timeout-inf",
    ),
    pytest.param(
        {"rendezvous_timeout": -5},
        r"rendezvous_timeout must be a whole number of seconds >= 1, got -5",
        id="rendezvous_timeout-negative",
    ),
    pytest.param(
        {"rendezvous_timeout": 10**9},
        r"rendezvous_timeout must be at most 604800 seconds \(a week\), got 1000000000",
        id="rendezvous_timeout-too-long",
    ),
    pytest.param(
        {"slot_timeout": float("nan")},
        r"slot_timeout must be a finite number of seconds > 0, got nan",
        id="slot_timeout-nan",
    ),
    pytest.param(
        {"slot_timeout": float("-inf")},
        r"slot_timeout must be a finite number of seconds > 0, got -inf",
        id="slot_timeout-inf",
    ),
    pytest.param(
        {"slot_timeout": 0},
        r"slot_timeout must be a finite number of seconds > 0, got 0",
        id="slot_timeout-0",
    ),
    pytest.param(
        {"stop_grace_period": -1},
        r"stop_grace_period must be a finite number of seconds >= 0 \(0: no grace, the run is killed at once\), got -1",
        id="stop_grace_period-negative",
    ),
    pytest.param(
        {"stop_grace_period": float("nan")},
        r"stop_grace_period must be a finite number of seconds >= 0 .*, got nan",
        id="stop_grace_period-nan",
    ),
    pytest.param(
        {"stop_grace_period": 86400},
        r"stop_grace_period must be at most 3600 seconds \(an hour\), got 86400: a stop that waits longer",
        id="stop_grace_period-too-long",
    ),
    pytest.param(
        {"stop_signal": "SIGKILL"},
        r"stop_signal must be one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, got 'SIGKILL'",
        id="stop_signal-uncatchable",
    ),
    pytest.param(
        {"stop_signal": 15},
        r"stop_signal must be one of SIGTERM, .*, got 15",
        id="stop_signal-number",
    ),
    pytest.param(
        {"hang_timeout": 5},
        r"hang_timeout must be a number of seconds from 10 to 604800 \(a week\), or None or 0 to turn the "
        r"hang watchdog off, got 5: ranks report their progress every 2 s",
        id="hang_timeout-too-short",
    ),
    pytest.param(
        {"hang_timeout": -30},
        r"hang_timeout must be a number of seconds from 10 to 604800 .*, got -30",
        id="hang_timeout-negative",
    ),
    pytest.param(
        {"hang_timeout": "soon"},
        r"hang_timeout must be a number of seconds from 10 to 604800 .*, got 'soon'",
        id="hang_timeout-not-a-number",
    ),
    pytest.param(
        {"max_xcom_output_bytes": -1},
        r"max_xcom_output_bytes must be an integer >= 0, got -1",
        id="max_xcom_output_bytes-negative",
    ),
    pytest.param(
        {"max_xcom_output_bytes": True},
        r"max_xcom_output_bytes must be an integer >= 0, got True",
        id="max_xcom_output_bytes-bool",
    ),
    pytest.param(
        {"max_xcom_output_bytes": 1.5},
        r"max_xcom_output_bytes must be an integer >= 0, got 1\.5",
        id="max_xcom_output_bytes-float",
    ),
    pytest.param({"local_mode": "yes"}, r"local_mode must be True or False, got 'yes'", id="local_mode-yes"),
    pytest.param({"use_gpu": "1"}, r"use_gpu must be True or False, got '1'", id="use_gpu-str-1"),
    pytest.param(
        {"allow_unencrypted": ""},
        r"allow_unencrypted must be True or False, got ''",
        id="allow_unencrypted-empty",
    ),
    pytest.param(
        {"spark_submit_kwargs": {"fast_jvm_start": "yes"}},
        r"fast_jvm_start must be True or False, got 'yes'",
        id="fast_jvm_start-yes",
    ),
    pytest.param(
        {"train_object": "/dags/train.sh"},
        r"train_object script '/dags/train\.sh' is not a \.py file.*or pass a callable",
        id="train_object-not-py",
    ),
    pytest.param(
        {"train_object": "/dags/torchdist_driver.py"},
        r"train_object script name 'torchdist_driver\.py' is the name of one of this provider's own "
        r"staged files \(.*payload\.pkl.*spec\.json.*\).*Rename the script",
        id="train_object-staged-name",
    ),
    pytest.param(
        {"train_object": "/dags/train,eval.py"},
        r"train_object script name 'train,eval\.py' contains ','.*--files splits.*Rename the file",
        id="train_object-comma",
    ),
    pytest.param(
        {"train_object": "/dags/train#2.py"},
        r"train_object script name 'train#2\.py' contains '#'.*'rename to'.*Rename the file",
        id="train_object-hash",
    ),
    pytest.param(
        {"checkpoint_dir": "ckpt"},
        r"checkpoint_dir 'ckpt' is not an absolute path.*Give an absolute path",
        id="checkpoint_dir-relative",
    ),
    pytest.param(
        {"checkpoint_dir": "nosuch://bucket/ckpt"},
        r"checkpoint_dir 'nosuch://bucket/ckpt' is not a path or a URI of a store fsspec knows.*s3://bucket",
        id="checkpoint_dir-uri",
    ),
    pytest.param(
        {"checkpoint_keep_best": 3},
        r"checkpoint_keep_best=3 needs checkpoint_metric",
        id="checkpoint_keep_best-without-metric",
    ),
    pytest.param(
        {"checkpoint_keep_last": 0},
        r"checkpoint_keep_last=0 with checkpoint_keep_best=0 would delete every checkpoint",
        id="checkpoint_keep_last-zero",
    ),
    pytest.param(
        {"checkpoint_mode": "lowest"},
        r"checkpoint_mode must be 'min' or 'max', got 'lowest'",
        id="checkpoint_mode-unknown",
    ),
    pytest.param(
        {"resume_from": "s3://bucket/ckpt"},
        r"resume_from='s3://bucket/ckpt' is neither 'latest' nor a checkpoint's URI",
        id="resume_from-not-a-checkpoint",
    ),
    pytest.param(
        {"output_path": "outputs"},
        r"output_path 'outputs' is not an absolute path.*Give an absolute path",
        id="output_path-relative",
    ),
    pytest.param(
        {"num_processes": "4:2"},
        r"num_processes='4:2': MIN=4 is more than MAX=2\. Write the fewest ranks first: num_processes=\"2:4\"",
        id="num_processes-range-upside-down",
    ),
    pytest.param(
        {"num_processes": "0:2"},
        r"num_processes='0:2': MIN must be at least 1",
        id="num_processes-range-min-0",
    ),
    pytest.param(
        {"num_processes": "2:"},
        r'num_processes must be an integer >= 1 or an elastic range "MIN:MAX" of two whole numbers',
        id="num_processes-range-malformed",
    ),
    pytest.param(
        {"num_processes": "2:3", "nproc_per_node": 2},
        r"num_processes='2:3': MAX=3 is not a multiple of nproc_per_node=2.*num_processes=\"2:4\"",
        id="num_processes-range-not-whole-nodes",
    ),
    pytest.param(
        {"num_processes": "2:4", "local_mode": True},
        r"num_processes='2:4' is an elastic range, but local_mode=True runs every rank on the Spark "
        r"driver.*no node to lose or add",
        id="num_processes-range-local_mode",
    ),
    pytest.param(
        {"train_data": 42},
        r"train_data must be a Spark SQL query .* a table name .* or a callable fn\(spark\) -> DataFrame, got int: 42",
        id="train_data-not-a-query",
    ),
    pytest.param(
        {"train_data": "  "},
        r"train_data must be a Spark SQL query",
        id="train_data-empty",
    ),
    pytest.param(
        {"train_data": "db.t", "num_processes": "2:4"},
        r"train_data with an elastic num_processes='2:4' is not supported yet",
        id="train_data-elastic",
    ),
    pytest.param(
        {"train_data_shuffle_seed": -1},
        r"train_data_shuffle_seed must be an integer >= 0, got -1",
        id="train_data_shuffle_seed-negative",
    ),
    pytest.param(
        {"train_data": "SELECT * FROM t WHERE day = :day", "train_data_args": {"day": ["2024-05-01"]}},
        r"train_data_args values must be strings, numbers, booleans or None, which Spark binds as literals; got day=list",
        id="train_data_args-not-a-literal",
    ),
    pytest.param(
        {"train_data": "db.events", "train_data_args": {"day": "2024-05-01"}},
        r"train_data_args \['day'\] bind the :name parameters of a train_data query, but train_data is the table name 'db.events'",
        id="train_data_args-without-a-query",
    ),
    pytest.param(
        {"join_window": "ten"},
        r"join_window must be an integer >= 1, got 'ten'",
        id="join_window-not-an-integer",
    ),
    pytest.param(
        {"join_window": 0},
        r"join_window must be an integer >= 1, got 0",
        id="join_window-zero",
    ),
    pytest.param(
        {"output_path": "file://host/outputs"},
        r"output_path 'file://host/outputs' is not an absolute path.*Write file:///absolute/path",
        id="output_path-file-uri-with-host",
    ),
]


@pytest.mark.parametrize("kwargs, message", PARSE_TIME)
def test_refused_when_the_dag_is_parsed(kwargs: dict, message: str, no_submit: list[str]) -> None:
    with pytest.raises(InvalidTrainingConfig, match=message):
        TorchDistributorOperator(task_id="train", **{"train_object": _train, **kwargs})
    assert no_submit == []


def test_good_values_of_the_new_checks_are_accepted() -> None:
    op = TorchDistributorOperator(
        task_id="train",
        train_object="/dags/train.py",
        num_processes=100_000,
        nproc_per_node=1000,
        rendezvous_timeout="600",
        slot_timeout=2,
        max_xcom_output_bytes=0,
        allow_unencrypted="false",
        checkpoint_dir="file:///shared/ckpt",
        output_path="s3://bucket/outputs",
        spark_submit_kwargs={"fast_jvm_start": "False"},
    )
    assert (op.rendezvous_timeout, op.slot_timeout, op.allow_unencrypted) == (600, 2.0, False)
    # fast_jvm_start is a setting of its own now; spark_submit_kwargs still takes it, as before.
    assert op.fast_jvm_start is False and "fast_jvm_start" not in op.spark_submit_kwargs
    assert op.training_spec().fast_jvm_start is False
    graceful = TorchDistributorOperator(
        task_id="g", train_object="/dags/train.py", stop_grace_period="0", stop_signal=" usr1 "
    )
    assert (graceful.stop_grace_period, graceful.stop_signal) == (0.0, "SIGUSR1")
    templated = TorchDistributorOperator(
        task_id="t", train_object="/dags/train.py", stop_grace_period="{{ params.grace }}"
    )
    assert "stop_grace_period" in templated.template_fields and "stop_signal" in templated.template_fields


def test_good_elastic_values_are_accepted_and_normalized() -> None:
    op = TorchDistributorOperator(
        task_id="train", train_object=_train, num_processes=" 2 : 4 ", nproc_per_node=2, join_window="1"
    )
    assert (op.num_processes, op.join_window) == ("2:4", 1)
    spec = op.training_spec()
    assert (spec.elastic, spec.min_processes, spec.max_processes) == (True, 2, 4)
    assert (spec.min_nodes, spec.num_nodes) == (1, 2)


def test_templated_range_rendering_to_a_bad_range_is_refused_before_the_hook(
    no_submit: list[str], made_hooks: list[TorchDistributorHook]
) -> None:
    op = TorchDistributorOperator(
        task_id="train", train_object=_train, num_processes="{{ params.min }}:{{ params.max }}"
    )  # left alone when the DAG is parsed
    op.render_template_fields({"params": {"min": 4, "max": 2}})
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes='4:2': MIN=4 is more than MAX=2"):
        op.execute({"ti": _TI()})
    assert made_hooks == [] and no_submit == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_processes": "4:2"}, r"MIN=4 is more than MAX=2"),
        ({"num_processes": "0:2"}, r"MIN must be at least 1"),
        ({"num_processes": "2:3", "nproc_per_node": 2}, r"MAX=3 is not a multiple of nproc_per_node=2"),
        ({"num_processes": "2:4", "local_mode": True}, r"no node to lose or add"),
        ({"join_window": 1.5}, r"join_window must be an integer >= 1, got 1\.5"),
    ],
    ids=["upside-down", "min-0", "not-whole-nodes", "local_mode", "join_window"],
)
def test_bad_elastic_settings_are_refused_by_the_hook_too(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidTrainingConfig, match=message):
        TorchDistributorHook(**kwargs)


def test_ssl_with_allow_unencrypted_is_accepted() -> None:
    TorchDistributorOperator(
        task_id="train", train_object=_train, conf={"spark.ssl.enabled": "true"}, allow_unencrypted=True
    )


class _TI:
    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "train", -1, 1
    stats_tags: dict = {}  # noqa: RUF012 (read by ResumableJobMixin)

    def xcom_push(self, key: str, value: object) -> None:
        pass


def test_templated_num_processes_rendering_to_abc_is_refused_before_the_hook(
    no_submit: list[str], made_hooks: list[TorchDistributorHook]
) -> None:
    op = TorchDistributorOperator(task_id="train", train_object=_train, num_processes="{{ params.n }}")
    op.render_template_fields({"params": {"n": "abc"}})
    assert op.num_processes == "abc"
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes must be an integer >= 1, got 'abc'"):
        op.execute({"ti": _TI()})
    assert made_hooks == [] and no_submit == []  # refused before any hook, let alone spark-submit


def test_templated_checkpoint_dir_rendering_to_a_relative_path_is_refused_before_the_hook(
    no_submit: list[str], made_hooks: list[TorchDistributorHook]
) -> None:
    op = TorchDistributorOperator(task_id="train", train_object=_train, checkpoint_dir="{{ params.dir }}")
    op.render_template_fields({"params": {"dir": "relative/ckpt"}})
    with pytest.raises(
        InvalidTrainingConfig, match=r"checkpoint_dir 'relative/ckpt' is not an absolute path"
    ):
        op.execute({"ti": _TI()})
    assert made_hooks == [] and no_submit == []


# -- at the start of the task, before spark-submit: the hook -------------------------------------


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    path = tmp_path / "staging"
    path.mkdir()
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once this socket is closed


def test_unknown_connection_id(no_submit: list[str]) -> None:
    with pytest.raises(InvalidTrainingConfig, match=r"Spark connection 'no_such_spark' is not defined") as e:
        TorchDistributorHook(conn_id="no_such_spark")
    assert "AIRFLOW_CONN_NO_SUCH_SPARK" in str(e.value)  # says how to define it


def test_deploy_mode_cluster_from_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://127.0.0.1:7077?deploy-mode=cluster")
    with pytest.raises(InvalidTrainingConfig, match=r"deploy_mode='cluster' is not supported.*client"):
        TorchDistributorHook()


def test_missing_script(tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"train_object script '.*nope\.py' does not exist"):
        hook.run(str(tmp_path / "nope.py"))
    _refused_before_submit(hook, staging, no_submit)


def test_script_with_kwargs_that_no_flag_can_carry(
    tmp_path: Path, staging: Path, no_submit: list[str]
) -> None:
    # kwargs are a script's flags ({"epochs": 3} -> --epochs 3); a list has no one flag form.
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"kwargs 'layers' is a list.*args=\['--layers'"):
        hook.run(str(script), layers=[64, 32])
    _refused_before_submit(hook, staging, no_submit)
    with pytest.raises(InvalidTrainingConfig, match=r"kwargs key 'no flag' cannot be a command-line flag"):
        TorchDistributorOperator(task_id="t", train_object=str(script), kwargs={"no flag": 1})  # at parse


def test_unpicklable_callable_closing_over_a_lock(staging: Path, no_submit: list[str]) -> None:
    lock = threading.Lock()

    def train_with_lock() -> int:
        with lock:
            return 1

    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(
        PayloadNotPicklable, match=r"closure variable 'lock'.*create locks.*inside the function"
    ):
        hook.run(train_with_lock)
    _refused_before_submit(hook, staging, no_submit)


def test_unpicklable_argument(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(PayloadNotPicklable, match=r"Cannot pickle the training payload: args\[0\] \(lock\)"):
        hook.run(_train, threading.Lock())
    with pytest.raises(PayloadNotPicklable, match=r"kwargs\['x'\] \(lock\)"):
        hook.run(_train, x=threading.Lock())
    _refused_before_submit(hook, staging, no_submit)


def test_unreachable_master_fails_fast(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    port = _closed_port()
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", f"spark://127.0.0.1:{port}")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    started = time.monotonic()
    with pytest.raises(
        SparkSubmitFailed, match=rf"Cannot reach the Spark master spark://127\.0\.0\.1:{port}"
    ) as e:
        hook.run(_train)
    assert time.monotonic() - started < 10  # not Spark's 3 x 20 s of registration retries
    assert "refused" in str(e.value) and "'spark_default'" in str(e.value)  # why, and which connection
    _refused_before_submit(hook, staging, no_submit)


@pytest.mark.parametrize("how", ["spark_binary", "PATH"])
def test_missing_spark_submit(how: str, tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    kwargs = (
        {"spark_binary": str(tmp_path / "no-spark" / "spark-submit")}
        if how == "spark_binary"
        else {"env_vars": {"PATH": str(tmp_path)}}  # a PATH without spark-submit on it
    )
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging), **kwargs)
    with pytest.raises(SparkSubmitFailed, match=r"spark-submit not found.*Install pyspark"):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


@pytest.mark.parametrize("local_mode", [False, True])
def test_no_torch_where_the_ranks_would_train(
    local_mode: bool, monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    """The embedded master and local mode train in this Python: without torch, refused before submit."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a)
    )
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, staging_dir=str(staging))
    with pytest.raises(
        SparkSubmitFailed, match=r"torch is not installed in .*airflow-provider-torchdist\[spark\].*doctor"
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_on_the_embedded_master(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=2, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(
        InvalidTrainingConfig, match=r"use_gpu=True in distributed mode needs a cluster.*local_mode=True"
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_on_a_cluster_without_spark_gpu_settings(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://127.0.0.1:7077")
    hook = TorchDistributorHook(num_processes=2, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=r"spark\.executor\.resource\.gpu\.amount.*use_gpu=False"):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_use_gpu_in_local_mode_without_gpus(
    monkeypatch: pytest.MonkeyPatch, staging: Path, no_submit: list[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine: no GPU
    hook = TorchDistributorHook(num_processes=2, local_mode=True, use_gpu=True, staging_dir=str(staging))
    with pytest.raises(
        InvalidTrainingConfig, match=r"needs 2 GPU\(s\) on the driver.*torch sees 0.*use_gpu=False"
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_ssl_enabled_without_allow_unencrypted(staging: Path, no_submit: list[str]) -> None:
    # Refused as the hook's spec is built: before anything is resolved, staged or run.
    with pytest.raises(InvalidTrainingConfig, match=r"spark\.ssl\.enabled=true.*allow_unencrypted=True"):
        TorchDistributorHook(num_processes=2, conf={"spark.ssl.enabled": "true"}, staging_dir=str(staging))
    assert no_submit == [] and list(staging.iterdir()) == []


class _FakeMaster(BaseHTTPRequestHandler):
    """A standalone master's web UI: two alive workers of 2 cores each."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps(
            {"workers": [{"state": "ALIVE", "cores": 2}, {"state": "ALIVE", "cores": 2}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def small_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Spark connection names a master whose web UI is :class:`_FakeMaster` (4 slots of 1 core)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeMaster)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    conn = {
        "conn_type": "spark",
        "host": "spark://127.0.0.1",
        "port": port,  # answers TCP, like a master would
        "extra": {"master-web-ui": f"http://127.0.0.1:{port}"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.usefixtures("small_cluster")
def test_too_many_processes_for_the_cluster(staging: Path, no_submit: list[str]) -> None:
    hook = TorchDistributorHook(num_processes=6, staging_dir=str(staging))
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"needs 6 task slot\(s\).*never offer more than 4.*Lower num_processes",
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


@pytest.mark.usefixtures("small_cluster")
def test_an_elastic_run_needs_only_its_min_nodes_slots() -> None:
    """An elastic run starts once MIN's nodes have joined: only a cluster that can never fit MIN
    fails fast, and the message says it is MIN that does not fit."""
    from airflow_provider_torchdist.submit.preflight import check_cluster_capacity

    log = logging.getLogger("test")
    fits = TorchDistributorHook(num_processes="2:8")  # 8 > the cluster's 4 slots, 2 fit
    assert check_cluster_capacity(fits.spec, fits.target, log) is None
    too_big = TorchDistributorHook(num_processes="6:8")
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"The elastic run \(num_processes='6:8'\) needs at least 6 task slot\(s\) of 1 cores each "
        r"at once to start \(MIN=6 ranks\), but the cluster .* can never offer more than 4",
    ):
        check_cluster_capacity(too_big.spec, too_big.target, log)


@pytest.mark.parametrize("name", ["torchdist_driver.py", "a,b.py", "a#b.py"])
def test_script_name_refused_by_the_hook(
    name: str, tmp_path: Path, staging: Path, no_submit: list[str]
) -> None:
    script = tmp_path / name
    script.write_text("print('hi')\n")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(staging))
    with pytest.raises(InvalidTrainingConfig, match=rf"train_object script name '{re.escape(name)}'"):
        hook.run(str(script))
    _refused_before_submit(hook, staging, no_submit)


@pytest.mark.parametrize(
    "checkpoint_dir, message",
    [
        pytest.param("ckpt", r"checkpoint_dir 'ckpt' is not an absolute path", id="relative"),
        pytest.param("~/ckpt", r"not an absolute path.*\(~ is not expanded\)", id="tilde"),
        pytest.param("nosuch://nn/ckpt", r"not a path or a URI of a store fsspec knows", id="uri"),
        pytest.param("file://host/ckpt", r"Write file:///absolute/path", id="file-uri-with-host"),
    ],
)
def test_checkpoint_dir_refused_by_the_hook(
    checkpoint_dir: str, message: str, staging: Path, no_submit: list[str]
) -> None:
    # Refused as the hook's spec is built: before anything is resolved, staged or run.
    with pytest.raises(InvalidTrainingConfig, match=message):
        TorchDistributorHook(num_processes=2, checkpoint_dir=checkpoint_dir, staging_dir=str(staging))
    assert no_submit == [] and list(staging.iterdir()) == []


def test_checkpoint_dir_that_cannot_be_written(tmp_path: Path, staging: Path, no_submit: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    hook = TorchDistributorHook(
        num_processes=2, checkpoint_dir=str(blocker / "ckpt"), staging_dir=str(staging)
    )
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"checkpoint_dir '.*/a-file/ckpt' \(resolved to .*\) is not a directory this Airflow worker "
        r"can write: Not a directory\..*or set checkpoint_dir to one",
    ):
        hook.run(_train)
    _refused_before_submit(hook, staging, no_submit)


def test_output_path_that_cannot_be_written(tmp_path: Path, no_submit: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    op = TorchDistributorOperator(task_id="train", train_object=_train, output_path=f"file://{blocker}/out")
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"output_path 'file://.*/a-file/out' \(resolved to .*\) is not a directory this Airflow "
        r"worker can write: Not a directory",
    ):
        op.execute({"ti": _TI()})
    assert no_submit == []


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_local_directories_are_created_private_and_test_written(tmp_path: Path, as_uri: bool) -> None:
    from airflow_provider_torchdist.submit.preflight import check_checkpoint_dir, check_output_path

    for check, name in ((check_checkpoint_dir, "ckpt"), (check_output_path, "out")):
        target = tmp_path / name / "dag" / "run"
        resolved = check(f"file://{target}" if as_uri else str(target))
        assert resolved == str(target.resolve())
        for made in (tmp_path / name, tmp_path / name / "dag", target):
            assert made.stat().st_mode & 0o777 == 0o700
        assert list(target.iterdir()) == []  # the test write left nothing behind
    assert check_output_path("s3://bucket/outputs") is None  # remote storage: left to its client
    assert check_checkpoint_dir(None) is None


def test_a_file_uri_checkpoint_dir_is_the_local_path_for_the_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from airflow_provider_torchdist.spark.node.checkpoints import CHECKPOINT_ENV, checkpoint_dir

    monkeypatch.setenv(CHECKPOINT_ENV, f"file://{tmp_path}/ckpt")
    assert checkpoint_dir() == tmp_path / "ckpt"  # what preflight checked, not a relative "file:/..."


# -- paths derived from the run's ids -----------------------------------------------------------

HOSTILE_RUN_IDS = [
    ".",
    "..",
    "a/../b",
    "a/b",
    "../../../etc",
    "/abs",
    "%2E%2E",
    "a%2Fb",
    ".hidden",
    "%2Ehidden",
    "manual__2024-01-01T00:00:00+00:00",
]


def _ti(run_id: str, task_id: str = "train", map_index: int = -1) -> _TI:
    ti = _TI()
    ti.run_id, ti.task_id, ti.map_index = run_id, task_id, map_index
    return ti


def _under(path: str, base: str) -> list[str]:
    """The components of ``path`` below ``base``; fails unless ``path`` stays under it."""
    normal = os.path.normpath(path)
    assert normal == path.rstrip("/") and normal.startswith(base + os.sep), (path, base)
    parts = normal[len(base) + 1 :].split(os.sep)
    assert not {".", "..", ""} & set(parts), parts
    return parts


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS)
def test_hostile_run_id_stays_under_the_base(run_id: str, tmp_path: Path) -> None:
    op = TorchDistributorOperator(task_id="train", train_object=_train, output_path=str(tmp_path / "out"))
    context = {"ti": _ti(run_id)}
    checkpoint = op.default_checkpoint_dir(context)
    base = os.path.join(os.environ["AIRFLOW_HOME"], "torchdist-checkpoints")
    assert len(_under(checkpoint, base)) == 3  # <dag>/<run>/<task>: the run id is one component
    assert len(_under(op.output_uri(context), str(tmp_path / "out"))) == 3


def test_distinct_ids_give_distinct_paths() -> None:
    op = TorchDistributorOperator(task_id="train", train_object=_train)
    tis = [_ti(run_id) for run_id in HOSTILE_RUN_IDS]
    # A task "t-1" and task "t" mapped at index 1, and ids differing only by an encoded character.
    tis += [_ti("r", "t-1"), _ti("r", "t", 1), _ti("r", "t@1"), _ti("r", "t%401")]
    checkpoints = {op.default_checkpoint_dir({"ti": ti}) for ti in tis}
    outputs = {op.output_uri({"ti": ti}) for ti in tis}
    assert len(checkpoints) == len(outputs) == len(tis)


# -- downstream, when the output is loaded --------------------------------------------------------


def test_envelope_from_another_deployment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tests.unit.outputs.test_results import to_xcom

    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-a" * 3)
    envelope = to_xcom(torch.arange(3), tmp_path)
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-b" * 3)
    with pytest.raises(OutputSignatureError, match=r"another \[torchdist\] output_signing_key.*Re-run"):
        load_output(envelope)


def test_every_error_here_is_one_of_the_providers() -> None:
    # Airflow fails the task on them; callers can catch the provider's base class.
    for error in (InvalidTrainingConfig, PayloadNotPicklable, SparkSubmitFailed):
        assert issubclass(error, TorchDistributorError)


def test_master_check_accepts_any_reachable_master_of_a_standalone_ha_list() -> None:
    from airflow_provider_torchdist.submit.preflight import check_master_reachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_master_reachable(f"spark://127.0.0.1:{_closed_port()},127.0.0.1:{port}", "spark_default")
    check_master_reachable("local[2]", "spark_default")  # not a standalone master: nothing to check
    with pytest.raises(
        SparkSubmitFailed, match=r"spark://10\.0\.0\.1 \(10\.0\.0\.1: no port, write spark://host:7077\)"
    ):
        check_master_reachable("spark://10.0.0.1", "spark_default")
