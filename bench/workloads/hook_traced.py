"""One launch through the hook, observed, for the launch profile.

``python hook_traced.py --local|--distributed [--supervised] --trace FILE [--conf KEY=VALUE ...] [--env KEY=VALUE ...]``

``--supervised``: the operator's path, ``start_run`` (a detached supervisor, which starts
spark-submit) and ``follow`` over its lifeline, instead of ``hook.run``.

Nothing in the package is patched or replaced. The run is observed two ways:

- the package's own phase events (:mod:`airflow_provider_torchdist.spark.wire.events`): this process sets
  ``TORCHDIST_EVENT_LOG=FILE`` before the hook runs, and every process of the run (the hook here,
  spark-submit's Python driver, the barrier tasks in Spark's Python workers, the torchrun agents,
  the ranks) inherits it and appends its events to FILE;
- a sampler thread that records when each process of the tree appears and disappears (psutil):
  the process starts no event can mark (the driver's interpreter, ``pyspark.daemon``, the workers).

Prints one ``RESULT {json}`` line: this process's own timestamps, the events, the sampled
processes, and the processes of the run still alive after ``hook.run`` returned.
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
from ddp_trivial import train  # noqa: E402

from airflow_provider_torchdist import TorchDistributorHook  # noqa: E402
from airflow_provider_torchdist.spark.wire.events import EVENT_LOG_ENV, read_events  # noqa: E402
from airflow_provider_torchdist.spark.wire.output_store import read_output  # noqa: E402

T_IMPORTED = time.time()


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

    def still_alive(self) -> list[dict[str, Any]]:
        """The sampled processes that still run (a process of the run the hook left behind)."""
        alive = []
        for rec in self.procs.values():
            try:
                p = psutil.Process(rec["pid"])
                if p.create_time() == rec["created"] and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append({"pid": rec["pid"], "cmd": rec["cmd"]})
            except psutil.Error:
                continue
        return alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true")
    mode.add_argument("--distributed", action="store_true")
    parser.add_argument(
        "--supervised",
        action="store_true",
        help="the operator's path: start_run + follow (a detached supervisor)",
    )
    parser.add_argument("--trace", required=True, help="file every process of the run appends events to")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark conf")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra spark-submit env"
    )
    parser.add_argument(
        "--no-fast-jvm-start", action="store_true", help="fast_jvm_start=False: Spark's own JVM defaults"
    )
    args = parser.parse_args()
    trace = os.path.abspath(args.trace)
    # Read at the first event (none has happened yet); every process of the run inherits it.
    os.environ[EVENT_LOG_ENV] = trace
    spawned = float(os.environ.get("BENCH_T_SPAWN", T_PROCESS))
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
    t_run = time.time()
    value = (
        hook.follow(hook.start_run(train, durable=False), read_output) if args.supervised else hook.run(train)
    )
    t_done = time.time()
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
                "rank0": value,
                "events": read_events(trace),
                "procs": list(sampler.procs.values()),
                "left_after_run": sampler.still_alive(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
