"""The torchrun agent's side: failure records, rank environment, launch configuration."""

from __future__ import annotations

import os
import socket

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from airflow_provider_torchdist.spark.node import rendezvous
from airflow_provider_torchdist.spark.node.launcher import (
    failure_from_process,
    launch_config,
    rank_environment,
)
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

NODE_KEY = bytes(range(32))  # the key the driver would give this node
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")


def _spec(**fields) -> JobSpec:
    base = dict(kind="callable", entry="payload.pkl", num_processes=4, run_id="run-1", token="t")
    return JobSpec(**{**base, **fields})


def _error_file(tmp_path, monkeypatch, exc: BaseException) -> str:
    """The error file torchrun's ErrorHandler writes for a rank that raised ``exc``."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def user_code():
        raise exc

    try:
        user_code()
    except BaseException as e:
        ErrorHandler().record_exception(e)
    assert path.exists()
    return str(path)


@pytest.fixture
def clean_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture
def has_lo():
    if "lo" not in {name for _, name in socket.if_nameindex()}:
        pytest.skip("this machine has no 'lo' interface")


# -- failure_from_process -----------------------------------------------------------------------


def test_failure_from_error_file(tmp_path, monkeypatch):
    error_file = _error_file(tmp_path, monkeypatch, ValueError("bad value: 3"))
    failure = ProcessFailure(local_rank=1, pid=1234, exitcode=1, error_file=error_file)
    record = failure_from_process(3, failure, "hostA")
    assert record.rank == 3
    assert record.host == "hostA"
    assert record.local_rank == 1
    assert record.exitcode == 1
    assert record.signal is None
    assert record.exc_type == "ValueError"
    assert record.message == "bad value: 3"  # split at the first ": " only
    assert "user_code" in record.traceback and "ValueError: bad value: 3" in record.traceback
    assert record.summary() == "rank 3 on hostA failed: ValueError: bad value: 3"


@pytest.mark.parametrize("exitcode, name", [(-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV")])
def test_killed_rank_gets_its_signal_name(tmp_path, exitcode, name):
    failure = ProcessFailure(local_rank=0, pid=99, exitcode=exitcode, error_file=str(tmp_path / "none.json"))
    record = failure_from_process(0, failure, "hostB")
    assert record.signal == name
    assert record.exitcode == exitcode
    assert record.exc_type is None and record.traceback is None
    assert record.summary() == f"rank 0 on hostB failed: killed by {name}"


def test_plain_exit_code_without_error_file(tmp_path):
    failure = ProcessFailure(local_rank=2, pid=99, exitcode=3, error_file=str(tmp_path / "none.json"))
    record = failure_from_process(5, failure, "hostC")
    assert (record.exitcode, record.signal, record.exc_type, record.message) == (3, None, None, None)
    assert record.summary() == "rank 5 on hostC failed: exited with code 3"


def test_fake_process_failure_is_enough():
    class Fake:
        local_rank = 0
        exitcode = 1
        error_file_data = {
            "message": {"message": "RuntimeError: NCCL error", "extraInfo": {"py_callstack": "Traceback..."}}
        }

        def signal_name(self):
            return "<N/A>"

    record = failure_from_process(7, Fake(), "h")
    assert (record.exc_type, record.message, record.traceback) == (
        "RuntimeError",
        "NCCL error",
        "Traceback...",
    )
    assert record.signal is None


def test_exception_without_message_keeps_its_type(tmp_path, monkeypatch):
    error_file = _error_file(tmp_path, monkeypatch, RuntimeError())
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=error_file)
    record = failure_from_process(0, failure, "h")
    assert record.exc_type == "RuntimeError"


# -- rank_environment ---------------------------------------------------------------------------


def test_loopback_gets_lo_and_several_ranks_one_thread(clean_env, has_lo):
    env = rank_environment(_spec(rank_env={"FOO": "bar"}), "127.0.0.1", 2)
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TORCHDIST_RUN_ID"] == "run-1"
    assert env["FOO"] == "bar"


def test_debug_sets_torchxs_preset_and_rank_env_wins(clean_env):
    assert "TORCH_DISTRIBUTED_DEBUG" not in rank_environment(_spec(), "127.0.0.1", 1)
    env = rank_environment(_spec(debug=True, rank_env={"NCCL_DESYNC_DEBUG": "0"}), "127.0.0.1", 1)
    assert env["CUDA_LAUNCH_BLOCKING"] == "1"
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert env["TORCH_SHOW_CPP_STACKTRACES"] == "1"
    assert env["NCCL_DESYNC_DEBUG"] == "0"  # the user's rank_env wins over the preset


def test_debug_travels_from_the_operator_to_the_ranks_spec():
    from airflow_provider_torchdist import TorchDistributorOperator
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

    op = TorchDistributorOperator(task_id="t", train_object=print, debug="{{ params.debug }}")
    op.debug = "True"  # as rendered
    job = JobSpec.for_run(op.training_spec(), kind="callable", entry="p", run_id="r", token="t")
    assert JobSpec.from_json(job.to_json()).debug is True


def test_one_local_rank_keeps_its_threads(clean_env):
    env = rank_environment(_spec(), "127.0.0.1", 1)
    assert "OMP_NUM_THREADS" not in env


def test_preset_cluster_environment_is_not_overridden(clean_env, has_lo):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "eth9")
    clean_env.setenv("OMP_NUM_THREADS", "8")
    env = rank_environment(_spec(), "127.0.0.1", 4)
    assert "GLOO_SOCKET_IFNAME" not in env  # the rank inherits the preset eth9
    assert "OMP_NUM_THREADS" not in env
    assert env["NCCL_SOCKET_IFNAME"] == "lo"  # not preset: still filled in


def test_explicit_socket_ifname_beats_everything(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "eth9")
    env = rank_environment(_spec(socket_ifname="ib0"), "127.0.0.1", 1)
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_unknown_address_sets_no_interface(clean_env):
    env = rank_environment(_spec(), "192.0.2.123", 1)  # TEST-NET-1: on no interface here
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env


def test_rank_env_is_applied_last(clean_env):
    env = rank_environment(_spec(rank_env={"OMP_NUM_THREADS": "6"}), "127.0.0.1", 4)
    assert env["OMP_NUM_THREADS"] == "6"


# -- launch_config ------------------------------------------------------------------------------


def test_local_mode_is_one_node_with_its_store_on_loopback(tmp_path):
    config = launch_config(
        _spec(local_mode=True, max_restarts=2),
        node_rank=0,
        master=None,
        host="127.0.0.1",
        log_dir=str(tmp_path),
    )
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 4)
    assert config.rdzv_backend == rendezvous.BACKEND  # static, its store bound to the endpoint's address
    assert config.rdzv_endpoint == "127.0.0.1:0"
    assert config.rdzv_configs["rank"] == 0
    assert config.max_restarts == 2
    assert config.run_id == "run-1"


def test_distributed_mode_is_static_rendezvous_at_node_0(tmp_path):
    spec = _spec(num_processes=6, nproc_per_node=2, rendezvous_timeout=42)
    config = launch_config(
        spec, node_rank=2, master=("10.0.0.1", 29500), host="10.0.0.3", log_dir=str(tmp_path)
    )
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (3, 3, 2)
    assert config.rdzv_backend == rendezvous.BACKEND
    assert config.rdzv_endpoint == "10.0.0.1:29500"
    assert config.rdzv_configs["rank"] == 2
    assert config.rdzv_configs["timeout"] == 42
    assert config.local_addr == "10.0.0.3"


def test_a_rendezvous_that_cannot_complete_fails_after_the_timeout_saying_so() -> None:
    """A real torchrun agent for node 0 of 2 whose peer never comes: no hang, a message to act on."""
    import time

    from airflow_provider_torchdist.spark.node.launcher import launch_node
    from airflow_provider_torchdist.spark.node.network import free_port

    spec = _spec(num_processes=2, rendezvous_timeout=2)
    started = time.monotonic()
    failures = launch_node(
        spec,
        node_rank=0,
        entry_path="/nonexistent",  # never reached: the ranks would start only after the rendezvous
        channel_address=("127.0.0.1", 1),
        host="127.0.0.1",
        master=("127.0.0.1", free_port("127.0.0.1")),
        node_key=NODE_KEY,
    )

    assert time.monotonic() - started < 30
    [failure] = failures
    assert failure.exc_type == "RendezvousTimeout"
    assert "rendezvous_timeout=2s" in failure.message
    assert "1/2 clients joined" in failure.message  # torch's own count of who arrived
    assert "socket_ifname" in failure.message


@pytest.mark.parametrize(
    "master, why",
    [(("127.0.0.1", 1), "Spark ended this task"), (None, "the driver was told to stop")],
    ids=["distributed", "local_mode"],
)
def test_an_agent_stopped_by_a_signal_says_which_and_why(monkeypatch, master, why) -> None:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from airflow_provider_torchdist.spark.node import launcher

    ran_with: list[tuple] = []

    def stopped(config, entrypoint):
        def run(*args):
            ran_with.append(args)
            raise SignalException(f"Process {1234} got signal: {signal.SIGHUP}", sigval=signal.SIGHUP)

        return run

    monkeypatch.setattr(launcher, "elastic_launch", stopped)
    [failure] = launcher.launch_node(
        _spec(num_processes=2),
        node_rank=0,
        entry_path="/x",
        channel_address=("127.0.0.1", 1),
        host="h",
        master=master,
        node_key=NODE_KEY,
    )
    # The ranks get their node and the node's key as arguments (not through the environment).
    [(*_, node, node_key)] = ran_with
    assert (node, node_key) == (0, NODE_KEY)
    # The driver's cue to ask Spark whether the executor was lost.
    assert failure.exc_type == "SignalException"
    assert failure.summary().startswith(
        f"a torchrun agent on h failed: SignalException: the torchrun agent was stopped by SIGHUP: {why}"
    )


@pytest.mark.parametrize("mode", ["local", "distributed", "elastic"])
def test_torchruns_cuda_question_does_not_start_cuda_before_the_ranks_fork(tmp_path, monkeypatch, mode):
    """LaunchConfig asks ``torch.cuda.is_available()``; asked the default way, it starts CUDA in the
    agent and every forked use_gpu rank fails ("Cannot re-initialize CUDA in forked subprocess",
    seen on an H100). It must be asked with torch's NVML-based check switched on."""
    import torch

    from airflow_provider_torchdist.spark.node.rank import NVML_CUDA_CHECK, NVML_SET_HERE

    for name in (NVML_CUDA_CHECK, NVML_SET_HERE):
        monkeypatch.setenv(name, "unset below, restored after")
        monkeypatch.delenv(name)
    asked_with = []
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: asked_with.append(os.environ.get(NVML_CUDA_CHECK))
    )
    where = {
        "local": dict(master=None),
        "distributed": dict(master=("10.0.0.1", 29500)),
        "elastic": dict(master=None, store=("10.0.0.1", 29501)),
    }[mode]
    launch_config(_spec(use_gpu=True), node_rank=0, host="10.0.0.3", log_dir=str(tmp_path), **where)
    assert asked_with, "LaunchConfig no longer asks torch.cuda.is_available(): this guard can go"
    assert set(asked_with) == {"1"}


@pytest.mark.parametrize("users", [None, "0", "1"])
def test_the_ranks_get_torchs_cuda_check_as_the_user_had_it(tmp_path, monkeypatch, users):
    """The NVML-based check is the agent's, set for the fork: a rank's training code gets whatever
    the user had (unset: torch's default check), never the launcher's setting."""
    from airflow_provider_torchdist.spark.node.rank import NVML_CUDA_CHECK, NVML_SET_HERE, restore_cuda_check

    for name in (NVML_CUDA_CHECK, NVML_SET_HERE):
        monkeypatch.setenv(name, "unset below, restored after")
        monkeypatch.delenv(name)
    if users is not None:
        monkeypatch.setenv(NVML_CUDA_CHECK, users)
    launch_config(_spec(use_gpu=True), node_rank=0, master=None, host="127.0.0.1", log_dir=str(tmp_path))
    assert os.environ[NVML_CUDA_CHECK] == (users or "1")  # the agent's, for the fork
    restore_cuda_check()  # what each rank does first
    assert os.environ.get(NVML_CUDA_CHECK) == users and NVML_SET_HERE not in os.environ
