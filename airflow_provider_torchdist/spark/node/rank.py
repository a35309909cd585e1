"""What each rank runs: load the work, call it, forward its output, send back rank 0's value.

Ranks are forked by torchrun's agent from a process that has already imported torch, so a rank
starts in milliseconds. Everything a rank prints goes through :class:`OutputCapture` to the driver.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from airflow_provider_torchdist.spark.node import (
    async_saves,
    group_keeper,
    progress,
    rank_context,
    script_output,
    stop,
)
from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.node.output_capture import OutputCapture
from airflow_provider_torchdist.spark.node.rank_output import send_output
from airflow_provider_torchdist.spark.node.watchdog import RankWatchdog
from airflow_provider_torchdist.spark.wire import parent_death
from airflow_provider_torchdist.spark.wire.events import emit
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
from airflow_provider_torchdist.spark.wire.protocol import (
    Message,
    StackRequest,
    StopAnswer,
    StopRequest,
    WorldSize,
    rank_prefix,
)
from airflow_provider_torchdist.spark.wire.stop_request import DECOMMISSIONED

_HERE = os.path.dirname(__file__)


#: torch's switch for a ``torch.cuda.is_available()`` that does not initialize CUDA (NVML's answer):
#: the launcher sets it for torchrun's agent, which forks the ranks (see launcher.launch_config).
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: Says the launcher set :data:`NVML_CUDA_CHECK` (the user had not), so a rank unsets both.
NVML_SET_HERE = "TORCHDIST_NVML_CUDA_CHECK_SET"


def restore_cuda_check() -> None:
    """Unset torch's NVML-based CUDA check when the launcher set it for the agent (not the user): the
    training code's ``torch.cuda.is_available()`` answers as it would under ``torchrun``."""
    if os.environ.pop(NVML_SET_HERE, None):
        os.environ.pop(NVML_CUDA_CHECK, None)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the torchrun agent) dies.

    A rank must never outlive its agent: an orphan keeps holding GPUs and ports.
    """
    parent_death.die_with_parent(signal.SIGKILL)


def rank_thread_count(
    nproc: int, *, environ: Mapping[str, str], task_cpus: int | None, cpus_allowed: int
) -> str | None:
    """The ``OMP_NUM_THREADS`` to give each of a node's ``nproc`` ranks; None keeps what they inherit.

    What the ``torchrun`` command would give them, fitted to the CPUs this node has:

    - a value already in the environment that the user set (the Airflow worker's or ``env_vars``
      in local mode, ``spark.executorEnv.OMP_NUM_THREADS`` on executors) is kept;
    - Spark gives its Python workers ``OMP_NUM_THREADS=spark.task.cpus`` of its own accord: that is
      the whole task's share, which its ranks split (``task_cpus`` is the barrier task's CPU count);
    - unset with several ranks: 1, as torchrun sets; unset with one rank: torch's own default.

    A derived count never exceeds the CPUs this process may run on (``cpus_allowed``, its CPU
    affinity, which executors started under a cpuset or ``taskset`` inherit) split between the ranks.
    Example: Spark's ``OMP_NUM_THREADS=8`` for an 8-CPU task running 4 ranks gives ``"2"`` each.
    """
    preset = environ.get("OMP_NUM_THREADS")
    if task_cpus is not None and preset == str(task_cpus):
        share = min(task_cpus, cpus_allowed)  # Spark's own value: the task's CPUs, split below
    elif preset:
        return None  # the user's choice
    elif nproc > 1:
        return "1"
    else:
        return None
    return str(max(1, share // nproc))


def apply_thread_count(environ: Mapping[str, str] | None = None) -> int | None:
    """Size torch's intra-op thread pool in this rank from its ``OMP_NUM_THREADS``.

    torch reads ``OMP_NUM_THREADS`` once per process. A rank forked from the agent inherits the
    agent's pool, sized when the agent imported torch, before the launcher set the ranks' value:
    without this, two ranks on two cores each ran two threads and trained at a third of the speed.
    Returns the count applied, None when the variable is unset or not a positive integer.
    """
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    try:
        count = int(value)
    except ValueError:
        return None
    if count < 1:
        return None
    import torch  # already imported by the agent this rank forked from

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def user_traceback(exc: BaseException) -> str:
    """The traceback from the user's first frame on: the frames of this module are noise to them."""
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _HERE:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """The fields of a :class:`RankFailure` that a rank knows about its own exception."""
    if isinstance(exc, SystemExit):
        return {"exc_type": "SystemExit", "message": f"exit code {exc.code}", "exitcode": exc.code}
    return {
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": user_traceback(exc),
    }


def call_entry(spec: JobSpec, entry_path: str) -> Any:
    """Run the user's work in this process: the pickled callable, or the script or module as
    ``__main__`` (``python script.py`` / ``python -m module``, with its args as ``sys.argv``)."""
    if spec.kind == "callable":
        with open(entry_path, "rb") as f:
            payload = cloudpickle.load(f)
        return payload["fn"](*payload["args"], **payload["kwargs"])
    if spec.kind == "module":
        sys.argv = [spec.entry, *spec.script_args]  # argv[0] becomes the module's file, as with -m
        try:
            found = importlib.util.find_spec(spec.entry)
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"train_object module {spec.entry!r} is not importable on this host: install it in "
                "the cluster's Python, or ship it with py_files=[...] (a package directory, .zip, .egg "
                "or .py)",
                name=spec.entry,
            )
        runpy.run_module(spec.entry, run_name="__main__", alter_sys=True)
        return None
    sys.argv = [entry_path, *spec.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(entry_path)))
    runpy.run_path(entry_path, run_name="__main__")
    return None


def call_work(spec: JobSpec, entry_path: str) -> Any:
    """:func:`call_entry`, with a script's or module's ``sys.exit(0)`` taken as its normal end (as
    its last line would be): rank 0 still hands on what it passed to ``set_output``."""
    script_output.begin(spec.kind)
    stop_keeping = group_keeper.start()  # group_keeper.py: torch can deadlock as the work returns
    try:
        try:
            value = call_entry(spec, entry_path)
        except SystemExit as exc:
            if exc.code not in (None, 0) or spec.kind == "callable":
                raise
            value = None
        # An asynchronous checkpoint save still uploading: the work ends once it is committed,
        # and a failed one fails the rank (a finished run and a graceful stop alike).
        async_saves.wait_for_checkpoints()
        return value
    finally:
        progress.work_done.set()  # for the hang watchdog: what follows is the runtime's, not a hang
        stop_keeping()


def connect_rank(
    spec: JobSpec, channel_address: tuple[str, int], host: str, node: int, node_key: bytes, rank: int
) -> ChannelClient | None:
    """This rank's connection to the driver, or None (said on stderr) when it cannot reach it: the
    rank trains on, its output then only in the log."""
    try:
        return ChannelClient.as_rank(
            channel_address,
            spec.token,
            node=node,
            rank=rank,
            generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            host=host,
            node_key=node_key,
        )
    except OSError as exc:
        prefix = rank_prefix(rank, host)
        print(f"[torchdist] {prefix} cannot reach the driver at {channel_address}: {exc}", file=sys.stderr)
        return None


def _on_driver_message(
    client: ChannelClient, message: Message, signame: str, watchdog: RankWatchdog | None
) -> None:
    """What the driver pushes to a rank: a stop request, answered with whether this rank watches
    for stops; a request for its stacks (the run is hung), answered by its watchdog (anything
    else is not for a rank: ignored)."""
    if isinstance(message, StopRequest):
        client.send(StopAnswer(stop.request_stop(message.reason, message.grace, signame)))
    elif isinstance(message, StackRequest) and watchdog is not None:
        client.send(watchdog.stacks())


def _listen_to_driver(spec: JobSpec, client: ChannelClient | None) -> Callable[[], None]:
    """Hear what the driver pushes (:func:`_on_driver_message`), and start the hang watchdog
    (``hang_timeout``), whose thread reports this rank's progress; returns what stops the watchdog."""
    watchdog = RankWatchdog(client.send) if client and spec.hang_timeout else None
    if client:
        client.listen(lambda message: _on_driver_message(client, message, spec.stop_signal, watchdog))
    if watchdog is None:
        return lambda: None
    watchdog.start()
    return watchdog.stop


def _wait_if_regrouping(spec: JobSpec) -> None:
    """An elastic run stopped for a decommissioned node goes on without it: this rank's return
    (after its checkpoint) is not the run's end, so it waits for its group's restart."""
    if spec.elastic and stop.stop_details()[0] == DECOMMISSIONED:
        stop.wait_for_regroup()


def run_rank(
    spec: JobSpec,
    entry_path: str,
    channel_address: tuple[str, int],
    host: str,
    output_dir: str | None,
    node: int,
    node_key: bytes,
) -> None:
    """The entry point torchrun's agent calls in every rank it forks.

    ``output_dir``: the driver's output directory when this rank runs on the driver's machine (local
    mode): rank 0 then writes its value there itself instead of streaming it over the channel.
    ``node`` and ``node_key``: this rank's node and the key it proves its identity with.
    """
    die_with_parent()
    restore_cuda_check()
    apply_thread_count()
    rank = int(os.environ["RANK"])
    prefix = rank_prefix(rank, host)
    client = connect_rank(spec, channel_address, host, node, node_key, rank)
    if client and spec.elastic and rank == 0:
        # Each generation of an elastic run has one rank 0: the driver learns the new world size
        # from it (and numbers the generation whose output this rank's connection may carry).
        client.send(WorldSize(int(os.environ["WORLD_SIZE"])))
    rank_context.set_client(client)  # for report()
    stop.install(spec.stop_signal)  # before the channel can deliver a stop: see stop.py
    stop_watchdog = _listen_to_driver(spec, client)
    capture = OutputCapture(client, prefix)
    capture.start()
    try:
        emit("rank_start", rank=rank)
        value = call_work(spec, entry_path)
        emit("rank_returned", rank=rank)
        _wait_if_regrouping(spec)
        if rank == 0:  # a script's value is what it set_output() (None if nothing)
            send_output(client, value if spec.kind == "callable" else script_output.taken(), output_dir)
            emit("output_sent", rank=rank)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            if client:
                client.error(describe_exception(exc))
            raise
        try:
            _wait_if_regrouping(spec)
        except RuntimeError as never_restarted:
            if client:
                client.error(describe_exception(never_restarted))
            raise
    except BaseException as exc:
        sys.stderr.write(user_traceback(exc))
        if client:
            client.error(describe_exception(exc))
        raise
    finally:
        stop_watchdog()
        capture.stop()
        if client:
            client.close()
        emit("rank_end", rank=rank)
