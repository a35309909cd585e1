"""The chaos soak: DAG runs of a small checkpointing training on a netns Spark cluster, through a
real Airflow deployment, each hit by one fault at a random moment of its training.

Used by ``bench/chaos.py`` (the full form: 40 runs, every fault, a table for docs/benchmarks.md)
and ``tests/integration/test_chaos.py`` (the short form in CI: one run of each fault but the disk).
The DAGs are ``tests/integration/dags/chaos_dags.py``.

After each run the soak checks four invariants:

- **outcome**: the run succeeded with the right value (``check``'s), or failed with a task log that
  names the fault;
- **steps**: no step trained twice, beyond the one each fault interrupted (rank 0's step log);
- **processes**: nothing of the run is left 30 s after it ended, by PID (and start time): the
  supervisor and all under it, spark-submit, the driver, the executors, their Python workers, the
  agents and the ranks, as seen while it ran;
- **staging**: no staging directory of the run is left (the supervisors' last argument).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.cluster import ClusterInfo, restart_lost_workers
from tests.integration.deployment import Deployment, wait_for
from tests.integration.run_processes import is_supervisor, of_this_worker, staging_of

STEPS = 60
#: Nothing of a run may be left this long after it ended.
LEFT_AFTER_S = 30
#: Every fault is one the run survives, with its one retry at most: the outcome invariant is a
#: success with the right value. A run may still fail only with a last task log that says what the
#: fault did, in the provider's own words; the faults not listed here must never fail a run.
NAMES_THE_FAULT = {
    "rank": ("failed: the process died without reporting an error",),
    "agent": ("Spark lost the executor", "a torchrun agent on"),
    "executor": ("Spark lost the executor",),
    "worker": ("Spark lost the executor",),
    "supervisor": (),
    "task": (),
    "triggerer": (),
    "link": ("Spark lost the executor",),
    "disk": ("No space left on device",),
    # Rank 1 SIGSTOPped (its watchdog thread with it): found hung within hang_timeout, named as
    # silent, its run stopped and the frozen rank killed; the retry resumes from the checkpoint.
    "frozen": ("training hung",),
}
FAULTS = tuple(NAMES_THE_FAULT)
#: What the command line of a run's process on an executor holds.
RUN_MARKS = ("pyspark", "CoarseGrainedExecutorBackend", "torch", "airflow_provider_torchdist")


@dataclasses.dataclass
class Bed:
    """Where the soak runs: the deployment, the cluster, a ``spark`` connection to the cluster's
    master, and (full form only) the staging disk the DAGs' ``TORCHDIST_CHAOS_STAGING`` names."""

    deployment: Deployment
    cluster: ClusterInfo
    conn_id: str
    work: Path
    staging_disk: Path | None = None


@dataclasses.dataclass
class Result:
    fault: str
    dag_id: str
    state: str
    tries: int
    held: dict[str, bool]
    detail: str = ""


def add_connection(deployment: Deployment, conn_id: str, cluster: ClusterInfo) -> None:
    """The ``spark`` connection to the cluster's master, through the REST API (the deployment runs)."""
    with contextlib.suppress(Exception):
        deployment.call("DELETE", f"/api/v2/connections/{conn_id}")
    deployment.call(
        "POST",
        "/api/v2/connections",
        {
            "connection_id": conn_id,
            "conn_type": "spark",
            "host": f"spark://{cluster.master_host}",
            "port": cluster.master_port,
        },
    )


class RunWatch:
    """Every process of the run seen while it runs (PID and start time), and its staging dirs."""

    def __init__(self, ranks: Path) -> None:
        self._ranks = ranks
        self._lock = threading.Lock()
        self.seen: set[tuple[int, float]] = set()
        self.staging: set[Path] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RunWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _note(self, proc: psutil.Process) -> None:
        with contextlib.suppress(psutil.Error), self._lock:
            self.seen.add((proc.pid, proc.create_time()))

    def _run(self) -> None:
        while not self._done.wait(0.5):
            for sup in supervisors():
                self._note(sup)
                with contextlib.suppress(psutil.Error, IndexError):
                    self.staging.add(staging_of(sup))
                    for child in sup.children(recursive=True):
                        self._note(child)
            for rank in live_ranks(self._ranks):
                self._note(rank)
                with contextlib.suppress(psutil.Error):
                    for parent in rank.parents():  # agent, Python daemon, executor; not the Worker
                        command = " ".join(parent.cmdline())
                        if "deploy.worker.Worker" in command or parent.pid == 1:
                            break  # (a rank whose agent was killed has init for its parent)
                        if any(mark in command for mark in RUN_MARKS):
                            self._note(parent)

    def left(self) -> dict[int, str]:
        with self._lock:
            seen = list(self.seen)
        alive = {}
        for pid, started in seen:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    alive[pid] = " ".join(proc.cmdline())[:120]
        return alive


def live_ranks(marker_dir: Path) -> list[psutil.Process]:
    """The ranks whose PID files name them: a process started after its file was written is a
    later one that reuses the PID of a rank that is gone."""
    found = []
    for rank in (0, 1):
        path = marker_dir / f"rank{rank}.pid"
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            proc = psutil.Process(int(path.read_text()))
            if proc.create_time() <= path.stat().st_mtime + 1.0:
                found.append(proc)
    return found


def supervisors() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if is_supervisor(proc) and of_this_worker(proc):
                found.append(proc)
    return found


def rank_pids(marker_dir: Path) -> dict[int, int]:
    found = {}
    for rank in (0, 1):
        with contextlib.suppress(OSError, ValueError):
            found[rank] = int((marker_dir / f"rank{rank}.pid").read_text())
    return found


def _ancestor(pid: int, marker: str) -> psutil.Process:
    for proc in psutil.Process(pid).parents():
        if marker in " ".join(proc.cmdline()):
            return proc
    raise LookupError(f"no {marker} above {pid}")


def inject(fault: str, bed: Bed, dag_id: str, run_id: str, marker_dir: Path) -> Callable[[], None]:
    """Do ``fault`` now; returns what undoes it once the run has ended (a no-op for most)."""
    rank1 = rank_pids(marker_dir)[1]
    if fault == "rank":
        os.kill(rank1, signal.SIGKILL)
    elif fault == "agent":
        psutil.Process(rank1).parent().send_signal(signal.SIGKILL)
    elif fault == "executor":
        _ancestor(rank1, "CoarseGrainedExecutorBackend").send_signal(signal.SIGKILL)
    elif fault == "worker":
        _ancestor(rank1, "deploy.worker.Worker").send_signal(signal.SIGKILL)
        # The host comes back a moment later, as a restarted machine's Worker does.
        threading.Timer(3.0, restart_workers, args=(bed.cluster,)).start()
    elif fault == "supervisor":
        max(supervisors(), key=lambda proc: proc.create_time()).send_signal(signal.SIGKILL)
    elif fault == "task":
        os.kill(bed.deployment.task_pid(dag_id, run_id, "train"), signal.SIGKILL)
    elif fault == "triggerer":
        bed.deployment.restart_triggerer(signal.SIGKILL)
    elif fault == "link":
        veth = bed.cluster.workers[1].host_veth
        subprocess.run(["ip", "link", "set", "dev", str(veth), "down"], check=True)
        up = ["ip", "link", "set", "dev", str(veth), "up"]
        timer = threading.Timer(random.uniform(5, 20), subprocess.run, args=(up,))
        timer.start()
        return lambda: (timer.join(), subprocess.run(up, check=False))  # type: ignore[func-returns-value]
    elif fault == "frozen":
        os.kill(rank1, signal.SIGSTOP)
    elif fault == "disk":
        assert bed.staging_disk is not None, "the disk fault needs the soak's own staging disk"
        filler = bed.staging_disk / "filler"
        with open(filler, "wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * (1 << 20))
        timer = threading.Timer(8.0, filler.unlink, kwargs={"missing_ok": True})
        timer.start()
        return lambda: (timer.join(), filler.unlink(missing_ok=True))  # type: ignore[func-returns-value]
    else:
        raise ValueError(f"unknown fault {fault!r}")
    return lambda: None


def one_run(bed: Bed, index: int, fault: str, rng: random.Random, timeout: float = 420) -> Result:
    """Trigger a run, hit it with ``fault`` at a random moment of its training, check the invariants."""
    dag_id = {"triggerer": "chaos_deferrable", "frozen": "chaos_hang_watch"}.get(fault, "chaos_durable")
    marker_dir = bed.work / f"run-{index:03d}-{fault}"
    marker_dir.mkdir(parents=True)
    conf = {
        "marker_dir": str(marker_dir),
        "steps": STEPS,
        "conn_id": bed.conn_id,
        "driver_host": bed.cluster.driver_host,
    }
    with RunWatch(marker_dir) as watch:
        run_id = bed.deployment.trigger(dag_id, conf)
        wait_for(lambda: len(rank_pids(marker_dir)) == 2, 300, "both ranks to train", interval=0.2)
        time.sleep(rng.uniform(0.3, 3.0))  # a random moment of the training
        undo = inject(fault, bed, dag_id, run_id, marker_dir)
        final = bed.deployment.wait_run(dag_id, run_id, timeout=timeout)
        undo()
    ended = time.monotonic()
    tries = int(bed.deployment.task_instance(dag_id, run_id, "train")["try_number"])
    held = {"outcome": _outcome_held(bed, dag_id, run_id, final["state"], fault, tries)}
    held["steps"] = _steps_held(marker_dir, tries)
    while (
        watch.left() or any(p.exists() for p in watch.staging)
    ) and time.monotonic() - ended < LEFT_AFTER_S:
        time.sleep(0.5)
    left, staging = watch.left(), [str(p) for p in watch.staging if p.exists()]
    # Something of the run was seen, or these two would hold for a run nobody watched.
    held["processes"] = bool(watch.seen) and not left
    held["staging"] = bool(watch.staging) and not staging
    detail = "" if all(held.values()) else json.dumps({"left": left, "staging": staging})[:2000]
    restart_workers(bed.cluster)  # a Worker the fault took down comes back for the next run
    return Result(fault, dag_id, final["state"], tries, held, detail)


_RESTARTS = threading.Lock()


def restart_workers(cluster: ClusterInfo) -> None:
    """Start again the Workers a fault killed (one caller at a time: a timer may race the run's end)."""
    with _RESTARTS:
        restart_lost_workers(cluster)


def _outcome_held(bed: Bed, dag_id: str, run_id: str, state: str, fault: str, tries: int) -> bool:
    if state == "success":
        value = bed.deployment.xcom(dag_id, run_id, "check")
        return value == {"steps": STEPS, "total": 2.0 * STEPS, "world_size": 2}
    log = bed.deployment.task_log(dag_id, run_id, "train", tries)
    return any(name in log for name in NAMES_THE_FAULT[fault])


def _steps_held(marker_dir: Path, tries: int) -> bool:
    """Each step at most twice, and at most one step twice per interruption: the fixed-size runs
    here have no in-run restarts, so each try after the first follows one."""
    log = marker_dir / "steps.log"
    if not log.exists():  # the fault came once both ranks trained: rank 0 logged a step
        return False
    steps = [int(line) for line in log.read_text().split()]
    counts: dict[int, int] = {}
    for step in steps:
        counts[step] = counts.get(step, 0) + 1
    twice = [s for s, n in counts.items() if n > 1]
    return all(n <= 2 for n in counts.values()) and len(twice) <= tries - 1


def table(results: list[Result]) -> str:
    """Markdown: per fault, the runs, how they ended, and how many held each invariant."""
    lines = [
        "| fault | runs | succeeded | failed, naming the fault | outcome | steps | processes | staging |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        rows = [r for r in results if r.fault == fault]
        if not rows:
            continue
        ok = sum(r.state == "success" for r in rows)
        named = sum(r.state != "success" and r.held["outcome"] for r in rows)
        held = {k: sum(r.held[k] for r in rows) for k in ("outcome", "steps", "processes", "staging")}
        n = len(rows)
        lines.append(
            f"| {fault} | {n} | {ok} | {named} | "
            + " | ".join(f"{held[k]}/{n}" for k in ("outcome", "steps", "processes", "staging"))
            + " |"
        )
    return "\n".join(lines)
