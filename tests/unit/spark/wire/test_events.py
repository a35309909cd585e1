"""Phase events: one JSON line per event when TORCHDIST_EVENT_LOG is set, nothing when it is not.

Each case runs ``emit`` in fresh interpreters, since the variable is read once per process.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import airflow_provider_torchdist
from airflow_provider_torchdist.spark.wire.events import (
    EVENT_LOG_ENV,
    FAST_START_OFF_ENV,
    PHASES,
    fast_start_off,
    read_events,
)

ROOT = Path(airflow_provider_torchdist.__file__).parent


def run_python(code: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if k != EVENT_LOG_ENV}
    return subprocess.Popen([sys.executable, "-c", code], env={**clean, **env}, cwd=cwd)


def test_emit_appends_one_line_per_event(tmp_path):
    log = tmp_path / "events.jsonl"
    code = (
        "from airflow_provider_torchdist.spark.wire.events import emit\n"
        "emit('driver_start')\n"
        "emit('agent_start', node=1)\n"
    )
    assert run_python(code, {EVENT_LOG_ENV: str(log)}, tmp_path).wait() == 0
    first, second = read_events(log)
    assert first["phase"] == "driver_start" and first["role"] == "driver"
    assert second == {**second, "phase": "agent_start", "role": "node", "node": 1, "pid": first["pid"]}
    assert first["t"] <= second["t"]
    assert oct(log.stat().st_mode & 0o777) == oct(0o600)


def test_emit_does_nothing_when_unset(tmp_path):
    code = "from airflow_provider_torchdist.spark.wire.events import emit\nemit('driver_start')\n"
    assert run_python(code, {}, tmp_path).wait() == 0
    assert list(tmp_path.iterdir()) == []


def test_emit_never_fails_the_run(tmp_path):
    code = "from airflow_provider_torchdist.spark.wire.events import emit\nemit('driver_start', x=object())\n"
    unwritable = tmp_path / "missing-dir" / "events.jsonl"
    assert run_python(code, {EVENT_LOG_ENV: str(unwritable)}, tmp_path).wait() == 0


def test_concurrent_writers_produce_whole_lines(tmp_path):
    log = tmp_path / "events.jsonl"
    writers, each = 6, 200
    code = (
        "from airflow_provider_torchdist.spark.wire.events import emit\n"
        f"for i in range({each}):\n"
        "    emit('rank_start', rank=i, pad='x' * 2000)\n"
    )
    procs = [run_python(code, {EVENT_LOG_ENV: str(log)}, tmp_path) for _ in range(writers)]
    assert all(p.wait() == 0 for p in procs)
    lines = log.read_text().splitlines()
    assert len(lines) == writers * each
    events = read_events(log)  # every line parses: none torn, none interleaved
    assert len(events) == writers * each
    by_pid: dict[int, list[int]] = {}
    for event in events:
        by_pid.setdefault(event["pid"], []).append(event["rank"])
    assert sorted(by_pid.values()) == [list(range(each))] * writers


def test_read_events_skips_a_torn_line(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"t": 1.0, "phase": "staged"}\n{"t": 2.0, "pha')
    assert read_events(log) == [{"t": 1.0, "phase": "staged"}]


def _emitted_phases() -> dict[str, list[str]]:
    """Every literal phase passed to ``emit`` in the package's source, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "emit"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.setdefault(node.args[0].value, []).append(f"{path.name}:{node.lineno}")
    return found


def test_every_emitted_phase_is_registered_and_every_registered_phase_is_emitted():
    emitted = _emitted_phases()
    assert set(emitted) - set(PHASES) == set(), "emit() of a phase missing from events.PHASES"
    assert set(PHASES) - set(emitted) == set(), "a phase in events.PHASES that nothing emits"
    assert {role for role, _ in PHASES.values()} == {"hook", "driver", "node", "rank"}


def test_fast_start_off():
    assert fast_start_off({}) == frozenset()
    assert fast_start_off({FAST_START_OFF_ENV: " jvm ,"}) == {"jvm"}
    assert fast_start_off({FAST_START_OFF_ENV: "all"}) == {"jvm", "pyspark", "torch"}
