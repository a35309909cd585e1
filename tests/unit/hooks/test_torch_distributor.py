"""TorchDistributorHook: the target, the spec and the plan (Spark settings, command, environment);
a run with spark-submit replaced by a fake that plays the driver's part (no Spark, no torchrun)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig

import cloudpickle
import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed, TrainingFailed
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE
from airflow_provider_torchdist.spark.wire.outcome import Outcome, RankFailure
from airflow_provider_torchdist.spark.wire.output_store import OutputManifest, read_output
from airflow_provider_torchdist.submit.plan import SPARK_PROPERTIES_FILE, submit_environment
from airflow_provider_torchdist.submit.preflight import check_gpu_conf
from tests.unit.conftest import plan_without_a_run, planned_properties

CLUSTER = "spark://127.0.0.1:7077"


@pytest.fixture
def cluster(monkeypatch):
    """A ``spark_default`` connection to a standalone master, from the environment."""
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", CLUSTER)


def _master_cores(master: str) -> int:
    match = re.fullmatch(r"local\[(\d+)\]", master)
    assert match, master
    return int(match.group(1))


# -- connection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_processes, nproc_per_node", [(4, 2), (3, 1), (6, 3), (2, 2)])
def test_embedded_master_fits_exactly_the_barrier_tasks(num_processes, nproc_per_node):
    hook = TorchDistributorHook(num_processes=num_processes, nproc_per_node=nproc_per_node)
    assert hook.embedded and hook.target.embedded
    props = planned_properties(hook)
    slots = _master_cores(hook.target.master) // int(props["spark.task.cpus"])
    assert slots == num_processes // nproc_per_node == hook.spec.num_nodes
    assert props["spark.task.cpus"] == str(nproc_per_node)


def test_embedded_master_in_local_mode_has_one_slot():
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, local_mode=True)
    assert hook.target.master == "local[1]"
    assert hook.spec.num_nodes == 1
    assert "spark.task.cpus" not in planned_properties(hook)


def test_embedded_master_stays_on_loopback():
    hook = TorchDistributorHook(num_processes=2)
    props = planned_properties(hook)
    assert props["spark.driver.host"] == "127.0.0.1"
    assert props["spark.driver.bindAddress"] == "127.0.0.1"
    assert submit_environment(hook.spec, hook.target, props)["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert hook.target.deploy_mode is None


def test_spark_default_connection_is_used_when_defined(cluster):
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2)
    assert hook.target.master == CLUSTER
    assert not hook.embedded
    props = planned_properties(hook)
    assert "spark.driver.host" not in props
    assert "SPARK_LOCAL_IP" not in submit_environment(hook.spec, hook.target, props)
    assert props["spark.task.cpus"] == "2"


def test_named_connection_is_used_when_defined(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_CLUSTER", "spark://10.1.2.3:7077")
    hook = TorchDistributorHook(conn_id="my_cluster")
    assert hook.target.master == "spark://10.1.2.3:7077"
    assert hook.spec.conn_id == "my_cluster"


def test_undefined_explicit_connection_is_refused_by_name():
    with pytest.raises(InvalidTrainingConfig, match=r"Spark connection 'my_cluster' is not defined") as e:
        TorchDistributorHook(conn_id="my_cluster")
    assert "AIRFLOW_CONN_MY_CLUSTER" in str(e.value)


def test_invalid_topology_is_refused():
    with pytest.raises(InvalidTrainingConfig, match="num_processes"):
        TorchDistributorHook(num_processes=0)
    with pytest.raises(InvalidTrainingConfig, match="not divisible"):
        TorchDistributorHook(num_processes=3, nproc_per_node=2)
    with pytest.raises(InvalidTrainingConfig, match="max_restarts"):
        TorchDistributorHook(max_restarts=-1)


def test_cluster_deploy_mode_is_refused(cluster):
    with pytest.raises(InvalidTrainingConfig, match="deploy_mode='cluster' is not supported"):
        TorchDistributorHook(deploy_mode="cluster")


def test_cluster_deploy_mode_from_the_connection_is_refused(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", CLUSTER + "?deploy-mode=cluster")
    with pytest.raises(InvalidTrainingConfig, match="deploy_mode='cluster' is not supported"):
        TorchDistributorHook()


def test_client_deploy_mode_is_fine(cluster, tmp_path):
    hook = TorchDistributorHook(deploy_mode="client")
    assert hook.target.deploy_mode == "client"
    assert plan_without_a_run(hook, tmp_path).submit_kwargs["deploy_mode"] == "client"


# -- Spark settings, the plan, environment ------------------------------------------------------


def test_user_conf_overrides_defaults():
    hook = TorchDistributorHook(
        num_processes=4,
        nproc_per_node=2,
        conf={"spark.log.level": "INFO", "spark.driver.host": "10.0.0.5", "spark.executor.memory": "2g"},
    )
    props = planned_properties(hook)
    assert props["spark.log.level"] == "INFO"
    assert props["spark.driver.host"] == "10.0.0.5"
    assert props["spark.driver.bindAddress"] == "127.0.0.1"  # defaults the user did not set remain
    assert props["spark.executor.memory"] == "2g"
    assert props["spark.ui.showConsoleProgress"] == "false"
    assert props["spark.task.cpus"] == "2"


def test_the_plan_carries_files_py_files_application_and_submit_options(tmp_path, fake_spark):
    hook = TorchDistributorHook(
        num_processes=2, executor_memory="1g", name="my-training", staging_dir=str(tmp_path)
    )
    hook.run(_add, 1)
    plan, staged = hook.plan, fake_spark.dir
    assert plan.connection == {"conn_type": "spark", "host": "local[2]"}
    assert plan.files == [str(staged / "payload.pkl")]
    assert plan.py_files == [str(staged / "torchdist_spark.zip")]
    assert plan.application == fake_spark.application == str(staged / "torchdist_driver.py")
    assert plan.application_args == [str(staged / "spec.json")]
    assert plan.submit_kwargs == {
        "executor_memory": "1g",
        "name": "my-training",
        "spark_binary": "spark-submit",
    }
    assert plan.properties_file == str(staged / SPARK_PROPERTIES_FILE)
    assert fake_spark.properties == plan.properties


def test_spark_submit_command_line_made_from_the_plan(tmp_path, fake_spark):
    """What the Spark provider makes of the plan: the one check of the command line itself."""
    hook = TorchDistributorHook(
        num_processes=2, executor_memory="1g", name="my-training", staging_dir=str(tmp_path)
    )
    hook.run(_add, 1)
    plan, staged = hook.plan, fake_spark.dir
    # No public API shows the command SparkSubmitHook runs: its private builder is the only route.
    cmd = fake_spark.spark_hook._build_spark_submit_command(fake_spark.application)
    assert cmd[:5] == ["spark-submit", "--master", "local[2]", "--properties-file", plan.properties_file]
    assert _option(cmd, "--files") == str(staged / "payload.pkl")
    assert _option(cmd, "--py-files") == str(staged / "torchdist_spark.zip")
    assert _option(cmd, "--executor-memory") == "1g"
    assert _option(cmd, "--name") == "my-training"
    assert cmd[-2:] == [str(staged / "torchdist_driver.py"), str(staged / "spec.json")]
    assert "--deploy-mode" not in cmd and "--conf" not in cmd


def test_default_name(tmp_path):
    assert plan_without_a_run(TorchDistributorHook(), tmp_path).submit_kwargs["name"] == "torchdist"


def test_environment_runs_spark_with_this_python(monkeypatch, tmp_path):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    env = plan_without_a_run(TorchDistributorHook(), tmp_path).env
    assert env["PYSPARK_PYTHON"] == sys.executable
    assert env["PYSPARK_DRIVER_PYTHON"] == sys.executable
    assert env["PATH"].split(os.pathsep)[0] == sysconfig.get_path("scripts")


def test_user_env_vars_win(monkeypatch, tmp_path):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    hook = TorchDistributorHook(env_vars={"PYSPARK_PYTHON": "/opt/py/bin/python", "X": "1"})
    env = plan_without_a_run(hook, tmp_path).env
    assert env["PYSPARK_PYTHON"] == "/opt/py/bin/python"
    assert env["X"] == "1"


def test_pyspark_python_conf_is_respected(monkeypatch, tmp_path):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    hook = TorchDistributorHook(conf={"spark.pyspark.python": "/opt/py/bin/python"})
    assert "PYSPARK_PYTHON" not in plan_without_a_run(hook, tmp_path).env


def _option(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} not in {cmd}"
    return cmd[cmd.index(name) + 1]


# -- GPUs ---------------------------------------------------------------------------------------


def _check_gpu_conf(hook: TorchDistributorHook) -> None:
    check_gpu_conf(hook.spec, hook.target, planned_properties(hook))


def test_gpu_on_a_cluster_without_gpu_conf_is_refused(cluster):
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, use_gpu=True)
    with pytest.raises(InvalidTrainingConfig) as e:
        _check_gpu_conf(hook)
    message = str(e.value)
    assert "spark.executor.resource.gpu.amount" in message
    assert "spark.executor.resource.gpu.discoveryScript" in message
    assert "spark.task.resource.gpu.amount" in message
    assert "nproc_per_node=2" in message


def test_gpu_is_refused_before_anything_is_staged(cluster, tmp_path, no_submit):
    hook = TorchDistributorHook(use_gpu=True, staging_dir=str(tmp_path))
    with pytest.raises(InvalidTrainingConfig):
        hook.run(_add, 1, 2)
    assert list(tmp_path.iterdir()) == []
    assert no_submit == [] and hook.plan is None


def test_gpu_on_a_cluster_with_gpu_conf_is_fine(cluster):
    hook = TorchDistributorHook(
        num_processes=4, nproc_per_node=2, use_gpu=True, conf={"spark.executor.resource.gpu.amount": "2"}
    )
    _check_gpu_conf(hook)
    props = planned_properties(hook)
    assert props["spark.task.resource.gpu.amount"] == "2"
    assert "spark.task.cpus" not in props


def test_gpu_in_local_mode_needs_no_spark_gpu_conf(cluster, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the driver's own GPUs are what count
    _check_gpu_conf(TorchDistributorHook(num_processes=2, use_gpu=True, local_mode=True))


def test_gpu_on_the_embedded_local_master_is_refused_with_a_way_out():
    # local[N] cannot assign GPUs to tasks: the stage would wait forever, so refuse before submitting.
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, use_gpu=True)
    with pytest.raises(InvalidTrainingConfig, match="cannot assign GPUs") as info:
        _check_gpu_conf(hook)
    assert "local_mode=True" in str(info.value)


# -- a run, with spark-submit faked -------------------------------------------------------------


def _add(a, b=0):
    return {"sum": a + b}


def test_run_returns_rank0_value_and_cleans_up(tmp_path, fake_spark):
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))
    fake_spark.outcome = Outcome(ok=True, metrics=[{"rank": 0, "step": 1, "loss": 0.5}])
    assert hook.run(_add, 2, b=3) == {"sum": 5}
    # Its own session (a kill reaches every process of the run), and nothing of ours on its stdin.
    env = fake_spark.kwargs.pop("env")
    # And it goes when the thread that started it dies, this process killed too (parent_death).
    bond = fake_spark.kwargs.pop("preexec_fn")
    assert callable(bond) and bond.__qualname__ == "signal_on_parent_death.<locals>.bond"
    assert fake_spark.kwargs == {"start_new_session": True, "stdin": subprocess.DEVNULL}
    # The plan's environment reaches spark-submit through Popen, over this process's.
    assert {k: env[k] for k in hook.plan.env} == hook.plan.env and env["PATH"] == hook.plan.env["PATH"]
    staged_dir = fake_spark.dir
    assert hook.plan.py_files == [str(staged_dir / "torchdist_spark.zip")]
    assert hook.plan.files == [str(staged_dir / "payload.pkl")]
    assert [hook.plan.application, *hook.plan.application_args] == [
        str(staged_dir / "torchdist_driver.py"),
        str(staged_dir / "spec.json"),
    ]
    assert hook.metrics == [{"rank": 0, "step": 1, "loss": 0.5}]
    assert not staged_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_the_hooks_world_sizes_are_the_outcomes_after_a_run(tmp_path, fake_spark):
    sizes = [
        {"time": 1.0, "world_size": 4, "reason": "start"},
        {"time": 2.5, "world_size": 2, "reason": "lost"},
    ]
    hook = TorchDistributorHook(num_processes="2:4", nproc_per_node=2, staging_dir=str(tmp_path))
    assert hook.world_sizes == []  # before a run
    fake_spark.outcome = Outcome(ok=True, world_sizes=sizes)
    hook.run(_add, 1)
    assert hook.world_sizes == sizes


def _pair(a, b=0):
    return (a, {b})  # not JSON-native: rank 0 pickles it


def test_run_returns_a_pickled_rank0_value_as_the_same_object(tmp_path, fake_spark):
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))

    def check_manifest(path):
        assert OutputManifest.read(path).format == "cloudpickle"
        return read_output(path)

    assert hook.run_to_path(_pair, [2], {"b": 3}, check_manifest) == (2, {3})
    assert hook.run(_pair, 2, b=3) == (2, {3})  # run() decodes the same way
    assert fake_spark.calls == 2
    assert not fake_spark.dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_spec_carries_the_hooks_settings(tmp_path, fake_spark):
    hook = TorchDistributorHook(
        num_processes=4,
        nproc_per_node=2,
        max_restarts=1,
        rendezvous_timeout=60,
        socket_ifname="eth1",
        rank_env={"SEED": 7},
        staging_dir=str(tmp_path),
    )
    hook.run(_add, 1)
    spec = fake_spark.spec
    assert (spec.num_processes, spec.nproc_per_node, spec.local_mode, spec.use_gpu) == (4, 2, False, False)
    assert (spec.max_restarts, spec.rendezvous_timeout, spec.socket_ifname) == (1, 60, "eth1")
    assert spec.rank_env == {"SEED": "7"}
    assert spec.num_nodes == 2


def test_script_run_returns_none(tmp_path, fake_spark):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    base = tmp_path / "staging"
    base.mkdir()
    hook = TorchDistributorHook(staging_dir=str(base))
    assert hook.run(str(script), "--epochs", 2) is None
    assert hook.plan.files == [str(fake_spark.dir / "train.py")]
    assert fake_spark.spec.script_args == ["--epochs", "2"]
    assert list(base.iterdir()) == []


def test_rank_failure_raises_training_failed(tmp_path, fake_spark):
    failure = RankFailure(
        rank=1, host="hostX", exitcode=1, exc_type="ValueError", message="boom", traceback="TB"
    )
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))
    fake_spark.outcome, fake_spark.raises = Outcome(ok=False, failures=[failure]), True
    with pytest.raises(TrainingFailed) as e:
        hook.run(_add, 1)
    assert e.value.failed_ranks == [1]
    assert "rank 1 on hostX failed: ValueError: boom" in str(e.value)
    assert "Traceback from rank 1 on hostX" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_no_outcome_raises_spark_submit_failed(tmp_path, fake_spark):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    fake_spark.outcome, fake_spark.raises = None, True
    with pytest.raises(SparkSubmitFailed, match="ended before the training driver reported.*spark-submit"):
        hook.run(_add, 1)
    assert list(tmp_path.iterdir()) == []


def test_success_without_output_raises(tmp_path, fake_spark):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    fake_spark.publish = False
    with pytest.raises(SparkSubmitFailed, match="never reached the driver"):
        hook.run(_add, 1)
    assert list(tmp_path.iterdir()) == []


def test_an_output_without_the_drivers_manifest_is_not_decoded(tmp_path, fake_spark):
    """A pickle dropped as output.pkl, with no manifest from the driver, is never unpickled."""
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    unpickled = []

    class Trap:
        def __reduce__(self):
            return (unpickled.append, (1,))

    fake_spark.publish = False
    fake_spark.also = lambda staged: (staged / OUTPUT_FILE).write_bytes(cloudpickle.dumps(Trap()))
    with pytest.raises(RuntimeError, match="no valid manifest"):
        hook.run(_add, 1)
    assert unpickled == []
    assert list(tmp_path.iterdir()) == []


def test_bad_args_are_refused_before_staging(tmp_path, no_submit):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    with pytest.raises(InvalidTrainingConfig, match="kwargs keys must be strings"):
        hook.run_to_path(_add, [1], {1: 2}, lambda path: pytest.fail("nothing may run"))
    assert list(tmp_path.iterdir()) == []
    assert no_submit == [] and hook.plan is None
