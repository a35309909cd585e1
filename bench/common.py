"""Shared helpers for the benchmarks: environment, timed subprocesses, machine facts, results file.

Every benchmark script writes its section of ``bench/results/latest.json`` through
:func:`update_results` and then re-renders ``docs/benchmarks.md`` and the README summary with
:mod:`bench.report`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORKLOADS = BENCH / "workloads"
DAGS = BENCH / "dags"
RESULTS = BENCH / "results" / "latest.json"
PYTHON = sys.executable
BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"

#: What every spark-submit in the benchmarks gets: loopback only, and the same quiet defaults the
#: hook gives its own application, so the comparison is like for like.
SPARK_CONF = {
    "spark.driver.host": LOOPBACK,
    "spark.driver.bindAddress": LOOPBACK,
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
}


def spark_submit_cmd(
    app: Path, *args: str, master: str = "local[2]", conf: dict[str, str] | None = None
) -> list[str]:
    """``spark-submit --master local[2] --conf ... app args`` with :data:`SPARK_CONF`."""
    cmd = [str(BIN / "spark-submit"), "--master", master]
    for key, value in {**SPARK_CONF, **(conf or {})}.items():
        cmd += ["--conf", f"{key}={value}"]
    return [*cmd, str(app), *args]


def bench_env(airflow_home: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment every benchmark process gets: loopback Spark, no Spark connection, quiet Airflow."""
    env = dict(os.environ)
    env.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["SPARK_LOCAL_IP"] = LOOPBACK
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS)
    if airflow_home is not None:
        env["AIRFLOW_HOME"] = str(airflow_home)
    env.update(extra)
    return env


def make_airflow_home(parent: Path | None = None) -> Path:
    """A fresh AIRFLOW_HOME with a migrated SQLite metadata DB (made once, before any timing)."""
    home = Path(tempfile.mkdtemp(prefix="bench-airflow-", dir=parent))
    proc = subprocess.run(
        [PYTHON, "-m", "airflow", "db", "migrate"], env=bench_env(home), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return home


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Sample:
    """One timed run of a command."""

    wall_s: float
    rc: int
    load_before: list[float]
    load_after: list[float]
    result: dict[str, Any] | None = None
    tail: str = field(default="", repr=False)


def run_timed(cmd: Sequence[str], env: dict[str, str], timeout: float = 600.0, cwd: Path = REPO) -> Sample:
    """Run ``cmd`` to its end; wall time from just before the fork to just after the exit.

    Output is captured (not echoed); a ``RESULT {json}`` line, if printed, is parsed into ``result``.
    """
    load_before = loadavg()
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
    return Sample(
        wall_s=round(wall, 3),
        rc=proc.returncode,
        load_before=load_before,
        load_after=loadavg(),
        result=result,
        tail=output[-4000:],
    )


def sample_dict(sample: Sample) -> dict[str, Any]:
    """A sample as JSON, without the output tail unless it failed."""
    data = asdict(sample)
    if sample.rc == 0:
        data.pop("tail")
    return data


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return round(statistics.median(values), 3) if values else None


def _first_line(cmd: Sequence[str]) -> str:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return ((proc.stdout or proc.stderr).strip().splitlines() or ["?"])[0]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, CPU model, memory, versions, date, load."""
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    versions = {}
    for dist in ("torch", "pyspark", "apache-airflow", "cloudpickle"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = "?"
    head = _first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--short", "--", "airflow_provider_torchdist"],
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_head": head,
        "package_uncommitted": [line.strip() for line in dirty if line.strip()],
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "java": _first_line([shutil.which("java") or "java", "-version"]),
        "versions": versions,
        "load_at_start": loadavg(),
    }


def load_results() -> dict[str, Any]:
    """``bench/results/latest.json``, or an empty dict."""
    try:
        return json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        return {}


def update_results(section: str, data: dict[str, Any]) -> None:
    """Replace one section of ``latest.json`` (the other sections are kept), atomically."""
    results = load_results()
    results[section] = data
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, RESULTS)


def log(message: str) -> None:
    """Progress to stderr with a timestamp and the load average."""
    load = " ".join(f"{x:.2f}" for x in loadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {message}", file=sys.stderr, flush=True)
