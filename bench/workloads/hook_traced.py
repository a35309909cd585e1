"""One instrumented launch through the hook, for the launch profile.

``python hook_traced.py --local|--distributed --trace FILE [--conf KEY=VALUE ...] [--env KEY=VALUE ...]``

Nothing in the package is edited. Instead, in this process only:

- the driver script the hook stages (``staging._DRIVER_SOURCE``) is swapped for one that appends
  timestamped events to FILE: driver start, imports done, SparkContext up/stop, channel close, and,
  inside each barrier task (the wrapper is pickled by value to the Python worker), task start,
  torch import (an import hook on the launcher module), the rendezvous endpoint's exchange through
  the driver, the torchrun agent's start and end;
- every line spark-submit prints is time-stamped on arrival (the hook logs each one);
- a sampler thread records when each process of the tree appears and disappears (psutil).

The rank's own timestamps come back in the workload's return value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

T_PROCESS = time.time()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
from airflow.providers.apache.spark.hooks import spark_submit as _submit_module  # noqa: E402
from ddp_trivial import train  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist import staging as _staging  # noqa: E402
from airflow_provider_torchdist.hooks import torch_distributor as _hook_module  # noqa: E402

T_IMPORTED = time.time()

_DRIVER_TEMPLATE = r"""
import json as _json, os as _os, sys, time as _time
_TRACE = {trace!r}


def _ev(name, **kw):
    line = _json.dumps({{"e": name, "t": _time.time(), "pid": _os.getpid(), **kw}}) + "\n"
    fd = _os.open(_TRACE, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o600)
    try:
        _os.write(fd, line.encode())
    finally:
        _os.close(fd)


_ev("driver_start")
import airflow_provider_torchdist.spark.barrier as _barrier
import airflow_provider_torchdist.spark.channel as _channel
import airflow_provider_torchdist.spark.driver as _driver

with open(sys.argv[1]) as _f:
    _LOCAL = _json.load(_f)["local_mode"]
if not _LOCAL:  # the real driver imports pyspark only in distributed mode
    import pyspark
_ev("driver_imported")


def _get(cls, conf=None):
    _ev("sc_create")
    sc = _orig_get(cls, conf)
    _ev("sc_up")
    stop = sc.stop

    def _stop():
        _ev("sc_stop")
        stop()
        _ev("sc_stopped")

    sc.stop = _stop
    return sc


if not _LOCAL:
    _orig_get = pyspark.SparkContext.getOrCreate.__func__
    pyspark.SparkContext.getOrCreate = classmethod(_get)

_orig_close = _channel.RunChannel.close


def _close(self):
    _ev("channel_close")
    _orig_close(self)
    _ev("channel_closed")


_channel.RunChannel.close = _close


def _wrap_launch_node(launcher, node):
    orig = launcher.launch_node

    def launch_node(*a, **kw):
        _ev("agent_start", node=node)
        try:
            return orig(*a, **kw)
        finally:
            _ev("agent_end", node=node)

    launcher.launch_node = launch_node


def _wrap_launcher(node):
    # Time the launcher's (torch's) import where the package does it, not earlier.
    import importlib.abc
    import importlib.util

    name = "airflow_provider_torchdist.spark.launcher"
    if name in sys.modules:
        _ev("launcher_imported", node=node)
        _wrap_launch_node(sys.modules[name], node)
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            spec.loader = _TracedLoader(spec.loader)  # a zipimporter is shared: wrap, never patch
            return spec

    class _TracedLoader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            _ev("launcher_imported", node=node)
            _wrap_launch_node(module, node)

    sys.meta_path.insert(0, _Finder())


_orig_task = _barrier.barrier_task


def _traced_task(spec, channel_address, it):
    from pyspark import BarrierTaskContext

    node = BarrierTaskContext.get().partitionId()
    _ev("task_start", node=node)
    orig_wait = _channel.ChannelClient.wait_for_master

    def wait_for_master(self, *a, **kw):
        _ev("rdzv_wait_start", node=node)
        try:
            return orig_wait(self, *a, **kw)
        finally:
            _ev("rdzv_wait_end", node=node)

    _channel.ChannelClient.wait_for_master = wait_for_master
    _wrap_launcher(node)
    yield from _orig_task(spec, channel_address, it)
    _ev("task_end", node=node)


_barrier.barrier_task = _traced_task
_orig_local = _driver.run_local


def _run_local(spec, staging):
    _ev("run_local")
    _wrap_launcher(0)
    return _orig_local(spec, staging)


_driver.run_local = _run_local
rc = _driver.main(sys.argv)
_ev("driver_main_done")
_driver.exit_now(rc)
"""


def session_members(sid: int) -> list[dict[str, Any]]:
    """Processes still in session ``sid`` (what the hook's kill of the process group would hit)."""
    found = []
    for p in psutil.process_iter(["pid", "ppid", "status", "cmdline", "create_time"]):
        try:
            if os.getsid(p.pid) == sid:
                found.append({**p.info, "cmdline": " ".join(p.info["cmdline"] or [])[:200], "t": time.time()})
        except (OSError, psutil.Error):
            continue
    return found


class ProcessSampler(threading.Thread):
    """Polls this process's descendants; records each one's start (psutil) and when it was last seen."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.procs: dict[int, dict[str, Any]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._stop_event.is_set():
            now = time.time()
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                children = []
            for p in children:
                rec = self.procs.get(p.pid)
                if rec is None:
                    try:
                        rec = {
                            "pid": p.pid,
                            "ppid": p.ppid(),
                            "created": p.create_time(),
                            "first_seen": now,
                            "cmd": " ".join(p.cmdline())[:300],
                        }
                    except psutil.Error:
                        continue
                    self.procs[p.pid] = rec
                elif not rec["cmd"]:
                    try:
                        rec["cmd"] = " ".join(p.cmdline())[:300]
                    except psutil.Error:
                        pass
                try:
                    if p.status() != psutil.STATUS_ZOMBIE:
                        rec["last_seen"] = now
                        # a process that exec()s keeps its pid: keep the latest command line
                        cmd = " ".join(p.cmdline())[:300]
                        if cmd and cmd != rec["cmd"]:
                            rec.setdefault("cmds", [rec["cmd"]]).append(cmd)
                            rec["cmd"] = cmd
                except psutil.Error:
                    pass
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def stamp_lines(hook: TorchDistributorHook, lines: list[tuple[float, str]], stamps: dict[str, float]) -> None:
    """Time-stamp every line spark-submit prints, as the hook reads it, and the end of its output."""
    process = hook._process_spark_submit_log

    def stamped(itr: Any) -> None:
        def each() -> Any:
            for line in itr:
                lines.append((time.time(), line.strip()[:300]))
                yield line
            stamps["stdout_eof"] = time.time()

        process(each())

    hook._process_spark_submit_log = stamped  # type: ignore[method-assign]


def stamp_calls(obj: Any, name: str, stamps: dict[str, float]) -> None:
    """Record when ``obj.name`` is called and when it returns (``name_start``, ``name_end``)."""
    orig = getattr(obj, name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        stamps[f"{name.strip('_')}_start"] = time.time()
        try:
            return orig(*a, **kw)
        finally:
            stamps[f"{name.strip('_')}_end"] = time.time()

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    parser.add_argument("--trace", required=True, help="file the driver and tasks append events to")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark conf")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra spark-submit env"
    )
    parser.add_argument(
        "--no-fast-jvm-start", action="store_true", help="fast_jvm_start=False: Spark's own JVM defaults"
    )
    args = parser.parse_args()
    spawned = float(os.environ.get("BENCH_T_SPAWN", T_PROCESS))
    _staging._DRIVER_SOURCE = _DRIVER_TEMPLATE.format(trace=os.path.abspath(args.trace))
    stamps: dict[str, float] = {}
    orig_stage = _hook_module.stage_run

    def stage_run(*a: Any, **kw: Any) -> Any:
        stamps["stage_start"] = time.time()
        try:
            return orig_stage(*a, **kw)
        finally:
            stamps["stage_end"] = time.time()

    _hook_module.stage_run = stage_run
    lines: list[tuple[float, str]] = []
    sampler = ProcessSampler()
    sampler.start()
    conf = dict(c.split("=", 1) for c in args.conf)
    env = dict(e.split("=", 1) for e in args.env)
    t_init = time.time()
    hook = TorchDistributorHook(
        num_processes=2,
        local_mode=args.local,
        use_gpu=False,
        conf=conf,
        env_vars=env or None,
        fast_jvm_start=not args.no_fast_jvm_start,
    )
    stamp_lines(hook, lines, stamps)
    leftovers: list[dict[str, Any]] = []
    orig_stop = hook._stop_process_group

    def stop_process_group(*a: Any, **kw: Any) -> None:
        proc = hook._submit_sp
        if proc is not None:
            leftovers.extend(session_members(proc.pid))
        orig_stop(*a, **kw)

    hook._stop_process_group = stop_process_group  # type: ignore[method-assign]
    for name in ("submit", "_stop_process_group"):
        stamp_calls(hook, name, stamps)
    stamp_calls(_hook_module.Outcome, "read", stamps)
    real_popen = _submit_module.subprocess.Popen

    def popen(*a: Any, **kw: Any) -> Any:
        stamps.setdefault("popen", time.time())
        return real_popen(*a, **kw)

    _submit_module.subprocess.Popen = popen  # type: ignore[misc]
    t_run = time.time()
    value = hook.run(train)
    t_done = time.time()
    _submit_module.subprocess.Popen = real_popen  # type: ignore[misc]
    time.sleep(0.1)
    sampler.stop()
    assert value["world_size"] == 2 and value["allreduce"] == 3.0, value
    print(
        "RESULT "
        + json.dumps(
            {
                "t_spawn": spawned,
                "t_process": T_PROCESS,
                "t_imported": T_IMPORTED,
                "t_init": t_init,
                "t_run": t_run,
                "t_done": t_done,
                **stamps,
                "rank0": value,
                "lines": lines,
                "procs": list(sampler.procs.values()),
                "left_in_session": leftovers,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
