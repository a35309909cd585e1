"""A graceful stop inside a rank (``spark/node/stop.py``): the flag, the signal, and the one delivery
it absorbs. Each case runs in a fresh Python, as a rank is a process of its own: real signals, real
handlers, and for ``all_ranks`` a real two-process gloo group."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_torchdist.spark.node import stop

ROOT = Path(__file__).resolve().parents[4]


def run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    source = "import os, signal, sys, time\nfrom airflow_provider_torchdist.spark.node import stop\n"
    return subprocess.run(
        [sys.executable, "-c", source + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_stop_turns_the_flag_on_and_its_own_signal_does_not_end_the_rank():
    done = run(
        """
        stop.install("SIGTERM")
        print("before", stop.stop_requested(), stop.stop_details())
        stop.request_stop("timeout", 30.0, "SIGTERM")
        time.sleep(0.3)  # the handler runs in the main thread
        reason, left = stop.stop_details()
        print("after", stop.stop_requested(), reason, 29 < left <= 30)
        stop.request_stop("again", 1.0, "SIGTERM")  # a second request changes nothing
        print("still", stop.stop_details()[0])
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before False (None, None)",
        "after True timeout True",
        "still timeout",
    ]


@pytest.mark.parametrize("after_a_stop", [False, True], ids=["no-stop", "after-the-stop"])
def test_any_other_sigterm_still_ends_the_rank_at_once(after_a_stop):
    """torchrun's agent ends its ranks with SIGTERM when the run is killed: the handler must not
    make a rank that ignores it linger (before a stop, or once the stop's own signal passed)."""
    done = run(
        f"""
        stop.install("SIGTERM")
        if {after_a_stop}:
            stop.request_stop("timeout", 30.0, "SIGTERM")
            time.sleep(0.3)
        print("alive", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
        """
    )
    assert done.returncode == -signal.SIGTERM
    assert done.stdout.splitlines() == ["alive"]


def test_the_rank_answers_whether_its_code_watches_for_stops():
    """Code that never asked stop_requested() and has no handler of its own gains nothing from a
    grace period: the answer lets the driver end the run at once. Asking once, or a handler of the
    user's own for the stop signal, counts as watching."""
    done = run(
        """
        import subprocess
        cases = {
            "never asked": "",
            "asked": "stop.stop_requested()",
            "own handler": "signal.signal(signal.SIGTERM, lambda *_: None)",
        }
        for name, setup in cases.items():
            code = ("import os, signal, time\\nfrom airflow_provider_torchdist.spark.node import stop\\n"
                    "stop.install('SIGTERM')\\n" + setup + "\\n"
                    "print(stop.request_stop('timeout', 5.0, 'SIGTERM'), stop.request_stop('x', 1.0, 'SIGTERM'))\\n"
                    "time.sleep(0.2)\\n")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
            print(name, out)
        """
    )
    assert done.returncode == 0, done.stderr
    # The second request of each is a repeat: never counted again.
    assert done.stdout.splitlines() == [
        "never asked False False",
        "asked True False",
        "own handler True False",
    ]


def test_a_handler_of_the_users_own_gets_the_stop_signal_they_chose():
    done = run(
        """
        stop.install("SIGUSR1")
        signal.signal(signal.SIGUSR1, lambda *_: print("the user's handler ran", flush=True))
        stop.request_stop("killed", 5.0, "SIGUSR1")
        time.sleep(0.3)
        print("flag", stop.stop_requested())
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the user's handler ran", "flag True"]


def test_a_sigint_that_is_not_a_stop_raises_keyboardinterrupt_as_before():
    done = run(
        """
        # Python's own SIGINT handler, as in a foreground process (a process started in the
        # background inherits SIGINT ignored, and then the stop's handler leaves it ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop.install("SIGINT")
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("KeyboardInterrupt")
        """
    )
    assert done.stdout.splitlines() == ["KeyboardInterrupt"], done.stderr


def test_a_signal_the_rank_inherited_ignored_stays_ignored():
    done = run(
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup or a background job leaves it
        stop.install("SIGINT")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        print("still here")
        """
    )
    assert done.returncode == 0 and done.stdout.splitlines() == ["still here"], done.stderr


def test_all_ranks_gives_every_rank_the_answer_of_any():
    """Rank 1 alone was told to stop: with ``all_ranks=True`` both ranks stop at the same step;
    without a stop both go on."""
    done = run(
        """
        import torch.distributed as dist
        import torch.multiprocessing as mp

        def rank(r, port, told, out):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=r, world_size=2)
            stop.install("SIGUSR2")
            if r in told:
                stop.request_stop("timeout", 30.0, "SIGUSR2")
            out.put((r, stop.stop_requested(), stop.stop_requested(all_ranks=True)))
            dist.destroy_process_group()

        if __name__ == "__main__":
            import socket
            for told in ((1,), ()):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
                queue = mp.get_context("fork").SimpleQueue()
                mp.start_processes(rank, args=(port, told, queue), nprocs=2, start_method="fork")
                print(sorted(queue.get() for _ in range(2)))
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[(0, False, True), (1, True, True)]",
        "[(0, False, False), (1, False, False)]",
    ]


def test_outside_a_run_nothing_is_requested():
    from airflow_provider_torchdist import stop_requested

    assert stop_requested() is False
    assert stop_requested(all_ranks=True) is False  # no process group: the local answer


def test_an_elastic_rank_that_returned_for_a_decommissioned_node_waits_for_its_regroup():
    """It must not end as a finished run would; it waits for the driver to restart its group, and
    raises (a failure the driver hears) only if that never comes."""
    done = run(
        """
        stop.install("SIGTERM")
        stop.REGROUP_WAIT_S = 0.3
        asked = time.monotonic()
        stop.request_stop("node decommissioned", 0.2, "SIGTERM")
        time.sleep(0.1)
        try:
            stop.wait_for_regroup()
        except RuntimeError as exc:
            print("raised", time.monotonic() - asked >= 0.5, str(exc)[:60])
        """
    )
    assert done.returncode == 0, done.stderr
    # The grace period from the stop request (0.2 s), then REGROUP_WAIT_S: a bound from the request
    # itself, which a loaded machine (a late wake from the sleep) cannot undercut.
    assert done.stdout.strip() == "raised True this rank checkpointed for a decommissioned node and waited"


def test_only_an_elastic_runs_decommission_stop_makes_a_returning_rank_wait(monkeypatch):
    from airflow_provider_torchdist.spark.node import rank
    from airflow_provider_torchdist.spark.wire.stop_request import DECOMMISSIONED

    waited = []
    monkeypatch.setattr(stop, "wait_for_regroup", lambda: waited.append(1))
    for elastic, reason, expected in (
        (True, DECOMMISSIONED, 1),
        (False, DECOMMISSIONED, 0),  # a fixed run ends: its retry resumes
        (True, "timeout", 0),  # a stopped elastic run ends too
        (True, None, 0),  # no stop: a finished run
    ):
        waited.clear()
        monkeypatch.setattr(stop, "stop_details", lambda reason=reason: (reason, 1.0))
        rank._wait_if_regrouping(SimpleNamespace(elastic=elastic))
        assert len(waited) == expected, (elastic, reason)
