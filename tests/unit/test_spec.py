"""TrainingSpec is the one declaration of every setting: the operator's and the hook's signatures,
template fields and docs follow it; its checks normalize; what travels to the cluster leaves the
secrets behind. And the package composes the Spark provider's hook instead of subclassing it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

import airflow_provider_torchdist
from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spec import (
    DEFAULT_CONN_ID,
    LINEAGE,
    OWNER,
    RUN,
    SETTINGS,
    SUBMIT,
    TRACKING,
    XCOM,
    TrainingSpec,
    default_of,
    settings_for,
    templated_settings,
)
from airflow_provider_torchdist.submit.checks import CHECKS, build_spec, check_settings

HOOK_SETTINGS = settings_for(RUN, SUBMIT)


# -- every setting declared once ----------------------------------------------------------------


def test_every_setting_declares_its_doc_scope_template_flag_and_a_known_check():
    for name, f in SETTINGS.items():
        assert f.metadata["doc"].strip(), name
        assert f.metadata["scope"] in (RUN, XCOM, OWNER, LINEAGE, SUBMIT, TRACKING), name
        assert isinstance(f.metadata["templated"], bool), name
        assert f.metadata["check"] in CHECKS, name
    assert TrainingSpec() == build_spec()  # the declared defaults pass their own checks


def _settings_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The parameters of ``cls`` that are settings (named ones and ``**spark_submit_kwargs``)."""
    params = inspect.signature(cls).parameters
    return {name: p for name, p in params.items() if name in SETTINGS}


def test_operator_signature_is_every_setting_with_its_default():
    params = _settings_parameters(TorchDistributorOperator)
    assert list(params) == list(SETTINGS)
    for name, param in params.items():
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert param.default == default_of(name), name
    others = [n for n in inspect.signature(TorchDistributorOperator).parameters if n not in SETTINGS]
    assert others == ["train_object", "args", "kwargs", "base_kwargs"]


def test_hook_signature_is_the_run_and_submit_settings_with_their_defaults():
    params = _settings_parameters(TorchDistributorHook)
    assert list(params) == HOOK_SETTINGS
    for name, param in params.items():
        if name == "spark_submit_kwargs":  # any other keyword is a SparkSubmitHook argument
            assert param.kind is inspect.Parameter.VAR_KEYWORD
        else:
            assert param.default == default_of(name), name
    assert not set(params) & set(settings_for(XCOM))  # how outputs travel through XCom: the operator's
    # The signature is the truth: binding the defaults gives the default spec.
    assert TorchDistributorHook().spec == build_spec()
    hook = TorchDistributorHook(2, True, False, nproc_per_node=2, executor_memory="1g")
    assert (hook.spec.num_processes, hook.spec.local_mode, hook.spec.nproc_per_node) == (2, True, 2)
    assert hook.spec.spark_submit_kwargs == {"executor_memory": "1g"}


def test_hook_takes_a_ready_spec():
    spec = build_spec(num_processes=4, nproc_per_node=2, conf={"spark.x": "1"})
    hook = TorchDistributorHook(spec=spec)
    assert hook.spec is spec
    assert hook.target.master == "local[4]"


def test_operator_template_fields_are_the_work_and_exactly_the_templated_settings():
    fields = TorchDistributorOperator.template_fields
    assert tuple(fields) == ("train_script", "train_args", "train_kwargs", *templated_settings())
    assert set(templated_settings()) == {n for n, f in SETTINGS.items() if f.metadata["templated"]}
    assert len(set(fields)) == len(fields)
    for name in TorchDistributorOperator.template_fields_renderers:
        assert name in fields, name


def test_every_setting_is_documented_in_both_classes():
    operator_doc = inspect.getdoc(TorchDistributorOperator)
    hook_doc = inspect.getdoc(TorchDistributorHook)
    for name in SETTINGS:
        line = f":param {name}: {SETTINGS[name].metadata['doc']}"
        assert line in operator_doc, name
        if name in HOOK_SETTINGS and name != "spark_submit_kwargs":
            assert line in hook_doc, name
        elif name not in HOOK_SETTINGS:
            assert f":param {name}:" not in hook_doc, name
    # The hook takes the Spark provider's arguments as plain keywords, and says so.
    assert "SparkSubmitHook" in hook_doc and "executor_memory" in hook_doc


# -- checks ---------------------------------------------------------------------------------------


def test_check_settings_at_parse_time_leaves_templates_for_after_rendering():
    settings = {
        "num_processes": "{{ params.n }}",
        "nproc_per_node": 3,  # cannot be checked against a template yet
        "conf": {"spark.ssl.enabled": "{{ params.ssl }}"},
        "checkpoint_dir": "{{ params.dir }}",
    }
    checked = check_settings(settings, at_parse_time=True)
    assert checked["num_processes"] == "{{ params.n }}"
    assert checked["nproc_per_node"] == 3
    assert checked["conf"] == {"spark.ssl.enabled": "{{ params.ssl }}"}
    assert checked["checkpoint_dir"] == "{{ params.dir }}"
    assert set(checked) == set(SETTINGS)  # defaults for the rest
    # After rendering a template left as it was is a bad value, named.
    with pytest.raises(InvalidTrainingConfig, match=r"num_processes must be an integer >= 1, got '\{\{"):
        check_settings(settings, at_parse_time=False)


def test_check_settings_rejects_unknown_settings_and_lists_the_known_ones():
    with pytest.raises(InvalidTrainingConfig, match=r"Unknown setting\(s\) 'num_procs', 'zzz'") as e:
        check_settings({"num_procs": 2, "zzz": 1, "num_processes": 2}, at_parse_time=True)
    for name in SETTINGS:
        assert name in str(e.value)
    with pytest.raises(InvalidTrainingConfig, match="Unknown setting"):
        build_spec(num_procs=2)


def test_build_spec_normalizes():
    spec = build_spec(
        num_processes="2",
        nproc_per_node="1",
        local_mode="true",
        use_gpu="False",
        max_restarts="3",
        rendezvous_timeout="60",
        slot_timeout=2,
        conf=None,
        env_vars=None,
        rank_env={"SEED": 7},
        socket_ifname="  ",
        spark_submit_kwargs=None,
    )
    assert (spec.num_processes, spec.nproc_per_node, spec.max_restarts, spec.rendezvous_timeout) == (
        2,
        1,
        3,
        60,
    )
    assert (spec.local_mode, spec.use_gpu) == (True, False)
    assert spec.slot_timeout == 2.0 and isinstance(spec.slot_timeout, float)
    assert (spec.conf, spec.env_vars, spec.spark_submit_kwargs) == ({}, {}, {})
    assert spec.rank_env == {"SEED": "7"}
    assert spec.socket_ifname is None
    assert spec.num_nodes == 1  # local mode: one torchrun agent


def test_build_spec_takes_fast_jvm_start_from_spark_submit_kwargs_too():
    given = {"fast_jvm_start": "False", "driver_memory": "1g"}
    spec = build_spec(spark_submit_kwargs=given)
    assert spec.fast_jvm_start is False and spec.spark_submit_kwargs == {"driver_memory": "1g"}
    assert given == {"fast_jvm_start": "False", "driver_memory": "1g"}  # the caller's dict is left alone


def test_spec_is_frozen_and_round_trips_as_a_dict():
    spec = build_spec(num_processes=4, nproc_per_node=2, conf={"spark.a": "1"}, rank_env={"A": "b"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_processes = 8  # type: ignore[misc]
    assert TrainingSpec.from_dict(spec.to_dict()) == spec
    assert TrainingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.num_nodes == 2


# -- what travels to the cluster -----------------------------------------------------------------


def test_jobspec_for_run_drops_what_only_spark_submit_needs():
    training = build_spec(
        num_processes=2,
        conn_id="my_cluster",
        conf={"spark.hadoop.fs.s3a.secret.key": "conf-secret"},
        env_vars={"DB_PASSWORD": "env-secret"},
        spark_submit_kwargs={"driver_memory": "2g", "principal": "me@REALM"},
        staging_dir="/private/staging",
        rank_env={"SEED": "1"},
        max_restarts=2,
    )
    job = JobSpec.for_run(training, kind="callable", entry="payload.pkl", run_id="r1", token="t" * 32)
    assert (job.conf, job.env_vars, job.spark_submit_kwargs) == ({}, {}, {})
    assert (job.conn_id, job.staging_dir) == (DEFAULT_CONN_ID, None)
    text = job.to_json()
    for secret in ("conf-secret", "env-secret", "me@REALM", "my_cluster", "/private/staging"):
        assert secret not in text  # secrets never travel to the driver and executors
    # What the ranks need is all there.
    assert (job.num_processes, job.max_restarts, job.rank_env) == (2, 2, {"SEED": "1"})
    assert (job.kind, job.entry, job.run_id, job.token) == ("callable", "payload.pkl", "r1", "t" * 32)


def test_jobspec_round_trips_through_json(tmp_path: Path):
    job = JobSpec.for_run(
        build_spec(num_processes=4, nproc_per_node=2, socket_ifname="eth0", checkpoint_dir="/ckpt"),
        kind="script",
        entry="train.py",
        run_id="r2",
        token="secret-token",
        script_args=["--epochs", "3"],
        slot_timeout=None,  # run time: wait as long as the cluster needs
    )
    assert JobSpec.from_json(job.to_json()) == job
    assert JobSpec.read(job.write(tmp_path)) == job
    assert isinstance(job, TrainingSpec) and job.num_nodes == 2


# -- composition, not inheritance ------------------------------------------------------------------

PACKAGE_DIR = Path(airflow_provider_torchdist.__file__).parent

#: Private attributes of objects the package does not own that it reads or writes anyway, each with
#: why (found by :func:`_private_accesses`). Keyed by module and expression; the lead decides.
ALLOWED_PRIVATE_ACCESS = {
    # Our own RunChannel, named ``channel`` inside the request handler class it defines.
    ("spark/driver/channel.py", "channel._serve"),
    # os._exit: a documented function; a process whose parent is gone leaves without teardown.
    ("spark/wire/parent_death.py", "os._exit"),
    # The local-mode driver ends without the interpreter's teardown (0.4 s with torch loaded).
    ("spark/driver/finish.py", "os._exit"),
    # A forked supervisor never returns into the task's code (as Airflow's forked task processes).
    ("supervision/forked.py", "os._exit"),
    # The executors' Python daemon, torch loaded, ends without teardown (pyspark's workers do too).
    ("spark/node/daemon.py", "os._exit"),
    # The one seam into another package: Spark's JVM through py4j (PySpark's StatusTracker stops at
    # job and stage counts). Every distributed integration run goes through it.
    ("spark/driver/jvm_status.py", "sc._jsc"),
    ("spark/driver/jvm_status.py", "sc._jvm"),
    # The second: PySpark's accumulator server, released before sc.stop() (spark_context.py,
    # release_accumulator_server; fast_jvm_start). Measured 0.94 s of sc.stop() without it.
    ("spark/driver/spark_context.py", "sc._accumulatorServer"),
    # sys._current_frames: documented ("for debugging"); the hang watchdog's thread reads where the
    # rank's main thread is, in-process, without ptrace (spark/node/watchdog.py, docs/hangs.md).
    ("spark/node/watchdog.py", "sys._current_frames"),
    # The default process group's sequence number (torch has no public counter of collectives):
    # a rank whose step is one long blocking call still issues its collectives (watchdog.py).
    ("spark/node/watchdog.py", "dist.group.WORLD._get_sequence_number_for_group"),
    # NCCL's flight recorder dumped on demand when a GPU run hangs (torch has no public call; it is
    # what torchtitan calls): _dump_fr_trace since torch 2.8, _dump_nccl_trace before (watchdog.py).
    ("spark/node/watchdog.py", "c10d._dump_fr_trace"),
    ("spark/node/watchdog.py", "c10d._dump_nccl_trace"),
}


def _private_accesses() -> set[tuple[str, str]]:
    """Every ``x._name`` (not ``self``/``cls``, not a dunder) and ``getattr(x, "_name")`` /
    ``setattr`` / ``hasattr`` / ``delattr`` in the package, as (module path, ``"x._name"``)."""
    found: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = path.relative_to(PACKAGE_DIR).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                base, attr = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                base, attr = node.args[0], node.args[1].value
            else:
                continue
            if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")):
                continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            found.add((module, f"{ast.unparse(base)}.{attr}"))
    return found


def test_no_module_subclasses_spark_submit_hook():
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b.rpartition(".")[2] == "SparkSubmitHook" for b in bases), (path, node.name)
    assert not issubclass(TorchDistributorHook, SparkSubmitHook)


def test_no_private_attributes_of_other_packages_beyond_the_allowed_seams():
    found = _private_accesses()
    assert sorted(found - ALLOWED_PRIVATE_ACCESS) == [], (
        "new private access: use a public API or allow it here"
    )
    assert sorted(ALLOWED_PRIVATE_ACCESS - found) == [], "allowed but no longer used: remove from the list"
    # Nothing of the Spark provider's hook in particular: neither its private methods nor the
    # attributes its constructor sets (a hook's instance attributes are not in ``vars`` of the class).
    spark_hook = SparkSubmitHook.__new__(SparkSubmitHook)
    instance = {"_conf", "_connection", "_env_vars", "_env", "_submit_sp", "_files", "_application_args"}
    private = {n for n in dir(spark_hook) if n.startswith("_") and not n.startswith("__")} | instance
    assert not {access for _, access in found if access.rpartition(".")[2] in private}


def test_every_setting_is_documented_in_the_reference_table():
    """The reference's operator table (docs/reference.md) lists every setting: adding one without
    its docs fails here."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    table = page[: page.index("**One spec.**")]
    missing = [name for name in SETTINGS if f"`{name}`" not in table]
    assert not missing, f"settings missing from docs/reference.md's operator table: {missing}"
