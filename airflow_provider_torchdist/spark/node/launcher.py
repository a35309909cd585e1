"""One torchrun agent: the elastic launcher that forks this node's ranks and watches them.

This is torchrun's own engine (``elastic_launch``), run in-process instead of as a ``torchrun``
command, so the ranks fork from a process that has already imported torch. Restarts
(``max_restarts``), error files and the environment torchrun gives its workers are all kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from typing import Any

from torch.distributed import DistStoreError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from airflow_provider_torchdist.spark.node.network import interface_for_address
from airflow_provider_torchdist.spark.node.rank import (
    NVML_CUDA_CHECK,
    NVML_SET_HERE,
    rank_thread_count,
    run_rank,
)
from airflow_provider_torchdist.spark.node.rendezvous import MONITOR_INTERVAL_S
from airflow_provider_torchdist.spark.node.rendezvous import register as register_rendezvous
from airflow_provider_torchdist.spark.node.signed_rendezvous import register as register_signed_rendezvous
from airflow_provider_torchdist.spark.node.watchdog import nccl_flight_recorder
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.private_files import AGENT_DIR_PREFIX, private_directory

LOOPBACK = "127.0.0.1"
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

# The agent logs each failed rank's traceback at ERROR; the rank already sent it, with its prefix.
logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)


#: Elastic runs: seconds between an agent's rendezvous heartbeats, and how many may be missed
#: before the others count its node as gone (torch's defaults, 5 s x 3, would add 15 s to every
#: resize after a loss).
KEEP_ALIVE_INTERVAL_S = 1
KEEP_ALIVE_MAX_ATTEMPTS = 3


def elastic_launch_config(
    spec: JobSpec, *, store: tuple[str, int], host: str, common: dict[str, Any]
) -> LaunchConfig:
    """torchrun ``--nnodes=MIN:MAX`` with the ``c10d`` rendezvous (its state signed:
    :mod:`.signed_rendezvous`) on the store the driver hosts.

    No agent hosts the store (``is_host=False``): the node that would host it may be the one lost.
    ``join_window`` is torchrun's last call: once MIN nodes have joined, how long the rendezvous
    still waits for more, up to MAX. ``rendezvous_timeout`` is how long it waits for MIN at all.
    """
    return LaunchConfig(
        min_nodes=spec.min_nodes,
        max_nodes=spec.num_nodes,
        nproc_per_node=spec.nproc_per_node,
        rdzv_endpoint=f"{store[0]}:{store[1]}",
        rdzv_configs={
            "is_host": False,
            "join_timeout": spec.rendezvous_timeout,
            "last_call_timeout": spec.join_window,
            "close_timeout": 30,
            "keep_alive_interval": KEEP_ALIVE_INTERVAL_S,
            "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPTS,
            "timeout": spec.rendezvous_timeout,
        },
        local_addr=host,
        **{**common, "rdzv_backend": register_signed_rendezvous()},
    )


def launch_config(
    spec: JobSpec,
    *,
    node_rank: int,
    master: tuple[str, int] | None,
    host: str,
    log_dir: str,
    store: tuple[str, int] | None = None,
) -> LaunchConfig:
    """torchrun's configuration for one node: static rendezvous, node rank = Spark partition id.

    Spark already placed the barrier tasks, so nothing is left for an elastic rendezvous to decide.
    The backend is torch's ``static`` with its store listening only on the address the nodes use
    (``spark/rendezvous.py``): task 0's address in distributed mode, 127.0.0.1 in local mode (one
    node, the ``--standalone`` case), instead of every interface. An elastic run (``store``: the
    driver's rendezvous store) is :func:`elastic_launch_config`'s.
    """
    # LaunchConfig asks torch.cuda.is_available(), which by default starts CUDA in this agent; the
    # ranks it then forks cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess": every
    # use_gpu=True rank failed so on an H100). torch's NVML-based check answers without starting it;
    # that changes only how the question is answered, and only in the agent.
    if NVML_CUDA_CHECK not in os.environ:  # the ranks unset it again (rank.restore_cuda_check)
        os.environ.update({NVML_CUDA_CHECK: "1", NVML_SET_HERE: "1"})
    common: dict[str, Any] = dict(
        run_id=spec.run_id,
        role="trainer",
        max_restarts=spec.max_restarts,
        monitor_interval=0.1 if store is not None else MONITOR_INTERVAL_S,  # elastic: torchrun's
        start_method="fork",
        rdzv_timeout=spec.rendezvous_timeout,
        rdzv_backend=register_rendezvous(),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    if store is not None:
        return elastic_launch_config(spec, store=store, host=host, common=common)
    if master is None:
        return LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=spec.num_processes,
            rdzv_endpoint=f"{LOOPBACK}:0",  # one node: a fresh port each round
            rdzv_configs={"rank": 0, "timeout": spec.rendezvous_timeout},
            **common,
        )
    return LaunchConfig(
        min_nodes=spec.num_nodes,
        max_nodes=spec.num_nodes,
        nproc_per_node=spec.nproc_per_node,
        rdzv_endpoint=f"{master[0]}:{master[1]}",
        rdzv_configs={"rank": node_rank, "timeout": spec.rendezvous_timeout},
        local_addr=host,
        **common,
    )


#: ``debug=True``: torchx's debug preset, for every rank (``rank_env`` wins over it).
DEBUG_ENV = {
    "CUDA_LAUNCH_BLOCKING": "1",
    "NCCL_DESYNC_DEBUG": "1",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "TORCH_SHOW_CPP_STACKTRACES": "1",
}


def rank_environment(spec: JobSpec, host: str, nproc: int, task_cpus: int | None = None) -> dict[str, str]:
    """What every rank's environment gets on top of torchrun's, unless the cluster set it already.

    ``task_cpus``: the barrier task's CPUs in distributed mode (None in local mode).
    """
    defaults = {"PYTHONUNBUFFERED": "1"}
    ifname = interface_for_address(host)
    if ifname:
        defaults["GLOO_SOCKET_IFNAME"] = defaults["NCCL_SOCKET_IFNAME"] = ifname
    env = {k: v for k, v in defaults.items() if k not in os.environ}
    threads = rank_thread_count(
        nproc, environ=os.environ, task_cpus=task_cpus, cpus_allowed=len(os.sched_getaffinity(0))
    )
    if threads:
        env["OMP_NUM_THREADS"] = threads
    if spec.socket_ifname:  # an explicit choice beats whatever the cluster set
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
    env["TORCHDIST_RUN_ID"] = spec.run_id
    if spec.elastic:
        # Each generation's rank 0 then serves its group's store afresh. Shared, the agents keep the
        # first generation's address, which a lost node takes with it, and a node that joins later
        # looks under another restart count's prefix than the survivors.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if spec.debug:
        env.update(DEBUG_ENV)
    env.update(nccl_flight_recorder(spec.use_gpu, spec.hang_timeout))  # docs/hangs.md
    env.update(spec.rank_env)
    return env


def failure_from_process(rank: int, failure: ProcessFailure, host: str) -> RankFailure:
    """Turn the agent's record of a dead rank into ours: exit code, signal, and the error file."""
    signal_name = failure.signal_name()
    record = RankFailure(
        rank=rank,
        host=host,
        local_rank=failure.local_rank,
        exitcode=failure.exitcode,
        signal=None if signal_name == "<N/A>" else signal_name,
    )
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    if isinstance(message, dict):
        text = str(message.get("message", ""))
        exc_type, sep, msg = text.partition(": ")
        record.exc_type, record.message = (exc_type, msg or None) if sep else (None, text or None)
        record.traceback = (message.get("extraInfo") or {}).get("py_callstack")
    return record


def rendezvous_failure(
    spec: JobSpec, exc: Exception, host: str, master: tuple[str, int] | None
) -> RankFailure:
    """A rendezvous that did not complete in time, said in the terms the user can act on."""
    if spec.elastic and isinstance(exc, DistStoreError) and master is not None:
        return RankFailure(
            rank=None,
            host=host,
            exc_type="RendezvousStoreUnreachable",
            message=f"this node could not reach the driver's rendezvous store at {master[0]}:{master[1]} "
            f"({exc}): a firewall between the executors and the driver's ports, or the driver is gone.",
        )
    if spec.elastic:
        return RankFailure(
            rank=None,
            host=host,
            exc_type="RendezvousTimeout",
            message=f"fewer than MIN={spec.min_processes} ranks met within rendezvous_timeout="
            f"{spec.rendezvous_timeout}s ({type(exc).__name__}: {exc}): nodes were lost and no "
            "replacement joined in time, or the cluster has fewer free task slots than MIN needs.",
        )
    where = f"task 0's address {master[0]}:{master[1]}" if master else "the driver"
    return RankFailure(
        rank=None,
        host=host,
        exc_type="RendezvousTimeout",
        message=f"the ranks did not all meet within rendezvous_timeout={spec.rendezvous_timeout}s "
        f"({type(exc).__name__}: {exc}). A node could not reach {where} (firewall, or the wrong "
        "interface: see socket_ifname) or started too late (raise rendezvous_timeout).",
    )


def agent_stopped(exc: SignalException, host: str, *, on_cluster: bool) -> RankFailure:
    """The failure of an agent told to stop by a signal, saying who stops it there."""
    why = (
        "Spark ended this task (its executor went away, or the stage was cancelled)"
        if on_cluster
        else "the driver was told to stop (the task was killed or timed out)"
    )
    return RankFailure(
        rank=None,
        host=host,
        exc_type="SignalException",
        message=f"the torchrun agent was stopped by {exc.sigval.name}: {why}",
    )


def launch_node(
    spec: JobSpec,
    *,
    node_rank: int,
    entry_path: str,
    channel_address: tuple[str, int],
    host: str,
    master: tuple[str, int] | None = None,
    task_cpus: int | None = None,
    output_dir: str | None = None,
    node_key: bytes,
    store: tuple[str, int] | None = None,
) -> list[RankFailure]:
    """Run this node's ranks to the end; return their failures (empty when all succeeded).

    ``master`` is node 0's rendezvous address in distributed mode, None in local mode;
    ``task_cpus`` the barrier task's ``spark.task.cpus`` (the ranks share them); ``output_dir`` the
    driver's output directory when this node runs on the driver (rank 0 writes its value there);
    ``node_key`` the key the driver gave this node, with which its ranks prove who they are;
    ``store`` the driver's rendezvous store in an elastic run (``master`` is then None; the caller
    gave :func:`.signed_rendezvous.use_key` the run's elastic key).
    """
    emit("agent_start", node=node_rank)
    nproc = spec.nproc_per_node if master is not None or store is not None else spec.num_processes
    os.environ.update(rank_environment(spec, host, nproc, task_cpus))
    # Named with this PID: the next agent on this host, or the Airflow worker's sweep (supervision/
    # sweep.py), removes it once this process is dead (SIGKILLed before the finally below ran).
    log_dir = private_directory(AGENT_DIR_PREFIX)
    # The agent installs its own handlers for these; a reused Spark Python worker must get back the
    # ones it had, or it would not die when its daemon later tells it to.
    saved = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        config = launch_config(
            spec, node_rank=node_rank, master=master, host=host, log_dir=log_dir, store=store
        )
        # The node key reaches the forked ranks as an argument, not through the environment.
        elastic_launch(config, run_rank)(
            spec, entry_path, channel_address, host, output_dir, node_rank, node_key
        )
        return []
    except ChildFailedError as exc:
        return [failure_from_process(rank, f, host) for rank, f in sorted(exc.failures.items())]
    except RendezvousClosedError:
        # Elastic runs: this node came late (a retried or pending task) and the run's last worker
        # group has already finished and closed the rendezvous. Nothing is left for it to do.
        emit("rendezvous_closed", node=node_rank)
        return []
    except (DistStoreError, RendezvousTimeoutError) as exc:
        return [rendezvous_failure(spec, exc, host, master or store)]
    except SignalException as exc:  # the agent itself was told to stop; it stopped its ranks first
        return [agent_stopped(exc, host, on_cluster=master is not None or store is not None)]
    except Exception as exc:  # no rank owns these
        return [RankFailure(rank=None, host=host, exc_type=type(exc).__name__, message=str(exc))]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        shutil.rmtree(log_dir, ignore_errors=True)
        emit("agent_end", node=node_rank)
