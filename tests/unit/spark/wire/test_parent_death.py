"""The kernel's bond between a process and its parent: a child goes when the process that started it
dies, however it dies, by no PID of the parent."""

from __future__ import annotations

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


def test_a_process_that_asked_to_die_with_its_parent_does() -> None:
    """``die_with_parent`` in the child itself (the driver, a rank): the parent's SIGKILL ends it."""
    code = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", (
            "import time\\n"
            "from airflow_provider_torchdist.spark.wire.parent_death import die_with_parent\\n"
            "die_with_parent()\\n"
            "print('bonded', flush=True)\\n"
            "time.sleep(120)\\n"
        )], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "bonded"
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive
