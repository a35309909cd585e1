"""TorchDistributorHook: connection, Spark conf, spark-submit command and environment; a run with
spark-submit replaced by a fake that plays the driver's part (no Spark, no torchrun)."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path

import cloudpickle
import pytest
from airflow.providers.common.compat.sdk import AirflowException

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed, TrainingFailed
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.spark.jobspec import OUTPUT_FILE, JobSpec
from airflow_provider_torchdist.spark.outcome import Outcome, RankFailure

CLUSTER = "spark://127.0.0.1:7077"


@pytest.fixture
def cluster(monkeypatch):
    """A ``spark_default`` connection to a standalone master, from the environment."""
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", CLUSTER)


def _master_cores(hook: TorchDistributorHook) -> int:
    match = re.fullmatch(r"local\[(\d+)\]", hook._connection["master"])
    assert match, hook._connection["master"]
    return int(match.group(1))


def _option(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} not in {cmd}"
    return cmd[cmd.index(name) + 1]


def _confs(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, arg in enumerate(cmd) if arg == "--conf")


# -- connection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_processes, nproc_per_node", [(4, 2), (3, 1), (6, 3), (2, 2)])
def test_embedded_master_fits_exactly_the_barrier_tasks(num_processes, nproc_per_node):
    hook = TorchDistributorHook(num_processes=num_processes, nproc_per_node=nproc_per_node)
    assert hook.embedded
    slots = _master_cores(hook) // int(hook._conf["spark.task.cpus"])
    assert slots == num_processes // nproc_per_node == hook.slots_needed
    assert hook._conf["spark.task.cpus"] == str(nproc_per_node)


def test_embedded_master_in_local_mode_has_one_slot():
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, local_mode=True)
    assert hook._connection["master"] == "local[1]"
    assert hook.slots_needed == 1
    assert "spark.task.cpus" not in hook._conf


def test_embedded_master_stays_on_loopback():
    hook = TorchDistributorHook(num_processes=2)
    assert hook._conf["spark.driver.host"] == "127.0.0.1"
    assert hook._conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert hook._env_vars["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert hook._connection["deploy_mode"] is None


def test_spark_default_connection_is_used_when_defined(cluster):
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2)
    assert hook._connection["master"] == CLUSTER
    assert not hook.embedded
    assert "spark.driver.host" not in hook._conf
    assert "SPARK_LOCAL_IP" not in hook._env_vars
    assert hook._conf["spark.task.cpus"] == "2"


def test_named_connection_is_used_when_defined(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_CLUSTER", "spark://10.1.2.3:7077")
    hook = TorchDistributorHook(conn_id="my_cluster")
    assert hook._connection["master"] == "spark://10.1.2.3:7077"


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


def test_client_deploy_mode_is_fine(cluster):
    hook = TorchDistributorHook(deploy_mode="client")
    assert hook._connection["deploy_mode"] == "client"


# -- conf, command, environment -----------------------------------------------------------------


def test_user_conf_overrides_defaults():
    hook = TorchDistributorHook(
        num_processes=4,
        nproc_per_node=2,
        conf={"spark.log.level": "INFO", "spark.driver.host": "10.0.0.5", "spark.executor.memory": "2g"},
    )
    confs = _confs(hook._build_spark_submit_command("app.py"))
    assert confs["spark.log.level"] == "INFO"
    assert confs["spark.driver.host"] == "10.0.0.5"
    assert confs["spark.driver.bindAddress"] == "127.0.0.1"  # defaults the user did not set remain
    assert confs["spark.executor.memory"] == "2g"
    assert confs["spark.ui.showConsoleProgress"] == "false"
    assert confs["spark.task.cpus"] == "2"


def test_command_carries_files_py_files_and_application():
    hook = TorchDistributorHook(num_processes=2, executor_memory="1g", name="my-training")
    hook._files = "/stage/payload.pkl"
    hook._py_files = "/stage/torchdist_spark.zip"
    hook._application_args = ["/stage/spec.json"]
    cmd = hook._build_spark_submit_command("/stage/torchdist_driver.py")
    assert cmd[0] == "spark-submit"
    assert _option(cmd, "--master") == "local[2]"
    assert _option(cmd, "--files") == "/stage/payload.pkl"
    assert _option(cmd, "--py-files") == "/stage/torchdist_spark.zip"
    assert _option(cmd, "--executor-memory") == "1g"
    assert _option(cmd, "--name") == "my-training"
    assert cmd[-2:] == ["/stage/torchdist_driver.py", "/stage/spec.json"]
    assert "--deploy-mode" not in cmd


def test_default_name():
    cmd = TorchDistributorHook()._build_spark_submit_command("a.py")
    assert _option(cmd, "--name") == "torchdist"


def test_environment_runs_spark_with_this_python(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    env = TorchDistributorHook()._env_vars
    assert env["PYSPARK_PYTHON"] == sys.executable
    assert env["PYSPARK_DRIVER_PYTHON"] == sys.executable
    assert env["PATH"].split(os.pathsep)[0] == sysconfig.get_path("scripts")


def test_user_env_vars_win(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    env = TorchDistributorHook(env_vars={"PYSPARK_PYTHON": "/opt/py/bin/python", "X": "1"})._env_vars
    assert env["PYSPARK_PYTHON"] == "/opt/py/bin/python"
    assert env["X"] == "1"


def test_pyspark_python_conf_is_respected(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    env = TorchDistributorHook(conf={"spark.pyspark.python": "/opt/py/bin/python"})._env_vars
    assert "PYSPARK_PYTHON" not in env


# -- GPUs ---------------------------------------------------------------------------------------


def test_gpu_on_a_cluster_without_gpu_conf_is_refused(cluster):
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, use_gpu=True)
    with pytest.raises(InvalidTrainingConfig) as e:
        hook.check_gpu_conf()
    message = str(e.value)
    assert "spark.executor.resource.gpu.amount" in message
    assert "spark.executor.resource.gpu.discoveryScript" in message
    assert "spark.task.resource.gpu.amount" in message
    assert "nproc_per_node=2" in message


def test_gpu_is_refused_before_anything_is_staged(cluster, tmp_path):
    hook = TorchDistributorHook(use_gpu=True, staging_dir=str(tmp_path))
    hook.submit = lambda *a, **k: pytest.fail("submit must not be called")
    with pytest.raises(InvalidTrainingConfig):
        hook.run_pickled(_add, [1, 2])
    assert list(tmp_path.iterdir()) == []


def test_gpu_on_a_cluster_with_gpu_conf_is_fine(cluster):
    hook = TorchDistributorHook(
        num_processes=4, nproc_per_node=2, use_gpu=True, conf={"spark.executor.resource.gpu.amount": "2"}
    )
    hook.check_gpu_conf()
    assert hook._conf["spark.task.resource.gpu.amount"] == "2"
    assert "spark.task.cpus" not in hook._conf


def test_gpu_in_local_mode_needs_no_spark_gpu_conf(cluster, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the driver's own GPUs are what count
    TorchDistributorHook(num_processes=2, use_gpu=True, local_mode=True).check_gpu_conf()


def test_gpu_on_the_embedded_local_master_is_refused_with_a_way_out():
    # local[N] cannot assign GPUs to tasks: the stage would wait forever, so refuse before submitting.
    hook = TorchDistributorHook(num_processes=4, nproc_per_node=2, use_gpu=True)
    with pytest.raises(InvalidTrainingConfig, match="cannot assign GPUs") as info:
        hook.check_gpu_conf()
    assert "local_mode=True" in str(info.value)


# -- a run, with spark-submit faked -------------------------------------------------------------


def _add(a, b=0):
    return {"sum": a + b}


class FakeSubmit:
    """Plays spark-submit plus the driver: records the command, runs the payload, writes the outcome."""

    def __init__(self, hook: TorchDistributorHook, outcome: Outcome | None = None, raises: bool = False):
        self.hook = hook
        self.outcome = outcome
        self.raises = raises
        self.cmd: list[str] = []
        self.kwargs: dict = {}
        self.dir: Path | None = None
        hook.submit = self

    def __call__(self, application: str = "", **kwargs):
        self.cmd = self.hook._build_spark_submit_command(application)
        self.kwargs = kwargs
        staged = self.hook._staged
        self.dir = staged.dir
        spec = JobSpec.read(self.cmd[-1])
        if spec.kind == "callable" and (self.outcome is None or self.outcome.ok):
            payload = cloudpickle.loads((staged.dir / spec.entry).read_bytes())
            value = payload["fn"](*payload["args"], **payload["kwargs"])
            (staged.dir / OUTPUT_FILE).write_bytes(cloudpickle.dumps(value))
        if self.outcome is not None:
            self.outcome.write(staged.dir)
        if self.raises:
            raise AirflowException("Cannot execute: spark-submit. Error code is: 1.")


def test_run_returns_rank0_value_and_cleans_up(tmp_path):
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))
    fake = FakeSubmit(hook, Outcome(ok=True, metrics=[{"rank": 0, "step": 1, "loss": 0.5}]))
    assert hook.run(_add, 2, b=3) == {"sum": 5}
    assert fake.kwargs == {"start_new_session": True}
    staged_dir = fake.dir
    assert _option(fake.cmd, "--py-files") == str(staged_dir / "torchdist_spark.zip")
    assert _option(fake.cmd, "--files") == str(staged_dir / "payload.pkl")
    assert fake.cmd[-2:] == [str(staged_dir / "torchdist_driver.py"), str(staged_dir / "spec.json")]
    assert hook.metrics == [{"rank": 0, "step": 1, "loss": 0.5}]
    assert not staged_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_spec_carries_the_hooks_settings(tmp_path):
    hook = TorchDistributorHook(
        num_processes=4,
        nproc_per_node=2,
        max_restarts=1,
        rendezvous_timeout=60,
        socket_ifname="eth1",
        rank_env={"SEED": 7},
        staging_dir=str(tmp_path),
    )
    seen = {}

    def submit(application="", **kwargs):
        seen["spec"] = JobSpec.read(hook._application_args[0])
        Outcome(ok=True).write(hook._staged.dir)
        (hook._staged.dir / OUTPUT_FILE).write_bytes(cloudpickle.dumps(None))

    hook.submit = submit
    hook.run(_add, 1)
    spec = seen["spec"]
    assert (spec.num_processes, spec.nproc_per_node, spec.local_mode, spec.use_gpu) == (4, 2, False, False)
    assert (spec.max_restarts, spec.rendezvous_timeout, spec.socket_ifname) == (1, 60, "eth1")
    assert spec.rank_env == {"SEED": "7"}
    assert spec.num_nodes == 2


def test_script_run_returns_none(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    base = tmp_path / "staging"
    base.mkdir()
    hook = TorchDistributorHook(staging_dir=str(base))
    fake = FakeSubmit(hook, Outcome(ok=True))
    assert hook.run_pickled(str(script), ["--epochs", 2]) is None
    assert _option(fake.cmd, "--files").endswith("/train.py")
    assert list(base.iterdir()) == []


def test_rank_failure_raises_training_failed(tmp_path):
    failure = RankFailure(
        rank=1, host="hostX", exitcode=1, exc_type="ValueError", message="boom", traceback="TB"
    )
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))
    FakeSubmit(hook, Outcome(ok=False, failures=[failure]), raises=True)
    with pytest.raises(TrainingFailed) as e:
        hook.run(_add, 1)
    assert e.value.failed_ranks == [1]
    assert "rank 1 on hostX failed: ValueError: boom" in str(e.value)
    assert "Traceback from rank 1 on hostX" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_no_outcome_raises_spark_submit_failed(tmp_path):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    FakeSubmit(hook, None, raises=True)
    with pytest.raises(SparkSubmitFailed, match="ended before the training driver reported.*spark-submit"):
        hook.run(_add, 1)
    assert list(tmp_path.iterdir()) == []


def test_success_without_output_raises(tmp_path):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))

    def submit(application="", **kwargs):
        Outcome(ok=True).write(hook._staged.dir)

    hook.submit = submit
    with pytest.raises(SparkSubmitFailed, match="never reached the driver"):
        hook.run(_add, 1)
    assert list(tmp_path.iterdir()) == []


def test_bad_args_are_refused_before_staging(tmp_path):
    hook = TorchDistributorHook(staging_dir=str(tmp_path))
    hook.submit = lambda *a, **k: pytest.fail("submit must not be called")
    with pytest.raises(InvalidTrainingConfig, match="kwargs keys must be strings"):
        hook.run_pickled(_add, [1], {1: 2})
    assert list(tmp_path.iterdir()) == []
