"""The kernel's bond between a process and its parent: a child goes when the process that started it
dies, however it dies, by no PID of the parent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from airflow_provider_torchdist.spark.wire.parent_death import signal_on_parent_death
    bond = signal_on_parent_death(signal.SIGTERM) if sys.argv[1] == "bond" else None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=bond)
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _child_of_a_killed_parent(bond: str) -> psutil.Process:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, bond], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()  # SIGKILL: no handler, no cleanup of its own
    parent.wait()
    return child


def test_a_bonded_child_gets_the_signal_when_its_parent_is_sigkilled() -> None:
    child = _child_of_a_killed_parent("bond")
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive  # (not our child: its exit status is its parent's, gone)


def test_without_the_bond_the_child_would_be_orphaned() -> None:
    """The control: the same child without the bond outlives its parent (so the test above can fail)."""
    child = _child_of_a_killed_parent("none")
    try:
        time.sleep(1.0)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        child.wait(10)


def test_die_with_parent_exits_at_once_when_the_parent_is_already_gone() -> None:
    """A process whose parent died before it asked (it was reparented to init) exits right away."""
    code = (
        "import os, sys, time\n"
        "if os.fork():\n"
        "    os._exit(0)\n"  # the parent goes at once
        "time.sleep(0.5)\n"
        "from airflow_provider_torchdist.spark.wire.parent_death import die_with_parent\n"
        "open(sys.argv[1], 'w').write(str(os.getppid()))\n"
        "die_with_parent()\n"
        "open(sys.argv[1], 'a').write(' still here')\n"
    )
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"parent-death-{os.getpid()}")
    try:
        subprocess.run([sys.executable, "-c", code, out], check=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        text = open(out).read()
    finally:
        if os.path.exists(out):
            os.unlink(out)
    if not text.startswith("1"):
        pytest.skip(f"orphans go to a subreaper here (parent {text}), not init: nothing to check")
    assert "still here" not in text
