"""The run supervisor: every ownership rule on an in-process RunSupervisor with a fake run, the
verdicts it reads, its lock and settings; then the real detached process with a fake spark-submit."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from airflow_provider_torchdist.spark.wire.outcome import Outcome, RankFailure
from airflow_provider_torchdist.spark.wire.output_store import read_output
from airflow_provider_torchdist.submit.checks import build_spec
from airflow_provider_torchdist.submit.connection import SparkTarget
from airflow_provider_torchdist.submit.plan import build_plan
from airflow_provider_torchdist.supervision.lifeline import (
    DoneEvent,
    ErrorEvent,
    LifelineError,
    LineEvent,
    OwnerConnection,
    RunGone,
    query_status,
)
from airflow_provider_torchdist.supervision.processes import is_alive, start_detached
from airflow_provider_torchdist.supervision.supervisor import (
    ADDRESS_FILE,
    ERROR_FILE,
    EXIT_LOCKED,
    LOCK_FILE,
    PLAN_FILE,
    SUPERVISOR_FILE,
    RunLock,
    RunLocked,
    RunSupervisor,
    SupervisorConfig,
    SupervisorStartError,
    read_private,
)
from airflow_provider_torchdist.supervision.sweep import process_start_ticks
from tests.unit.conftest import publish_value, wait_until

SECRET = b"k" * 32
RUN = "run-1"
#: Owner silence in these tests (the real one is 15 s). It is also how long a run that is not
#: durable waits for its first owner, timed from ``listen()``: CI's loaded 2 cores have taken
#: most of a second between the harness's listen and its owner's attach.
SILENCE = 1.2


class FakeRun:
    """spark-submit, played by a thread that waits: ``end(...)`` finishes it as the driver would."""

    def __init__(self) -> None:
        self.session: int | None = None
        self.started = threading.Event()
        self.killed = threading.Event()
        self._end = threading.Event()
        self._raises: str | None = None

    def run(self) -> None:
        self.started.set()
        while not self._end.wait(0.01):
            if self.killed.is_set():
                raise RuntimeError("spark-submit was killed")
        if self._raises:
            raise RuntimeError(self._raises)

    def kill(self) -> None:
        self.killed.set()

    def end(self, raises: str | None = None) -> None:
        self._raises = raises
        self._end.set()


class Harness:
    """One in-process supervisor on 127.0.0.1, serving in a thread."""

    def __init__(
        self, tmp_path: Path, *, durable: bool, reattach: float, output: bool = True, grace: float = 0.0
    ) -> None:
        self.staging = tmp_path / "torchdist-run"
        self.staging.mkdir(mode=0o700)  # as stage_run's mkdtemp makes it: the lifeline is a unix socket
        self.config = SupervisorConfig(
            run_id=RUN,
            durable=durable,
            reattach_timeout=reattach,
            bind_host="127.0.0.1",
            checkpoint_dir=None,
            owner_secret=SECRET,
            output_file=self.staging / "output.pkl" if output else None,
            stop_grace_period=grace,
        )
        self.run = FakeRun()
        self.supervisor = RunSupervisor(
            self.staging,
            self.config,
            make_run=lambda: self.run,
            follow=False,
            silence_s=SILENCE,
            ping_interval=0.05,
        )
        self.host, self.port = self.supervisor.listen()
        self.code: int | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.run.started.wait(5)

    def _serve(self) -> None:
        self.code = self.supervisor.serve()

    def owner(self, kind: str = "task", since: int = 0, pings: bool = True) -> OwnerConnection:
        return OwnerConnection(
            self.host, self.port, RUN, SECRET, kind=kind, since=since, ping_interval=0.05 if pings else 60
        )

    def succeed(self, value: Any = 42) -> None:
        publish_value(value, self.staging)
        Outcome(ok=True, metrics=[{"rank": 0, "loss": 0.1}]).write(self.staging)
        self.run.end()

    @property
    def torn_down(self) -> bool:
        return not self.thread.is_alive()

    def wait_torn_down(self, timeout: float = 5.0) -> None:
        wait_until(lambda: self.torn_down, timeout, "the teardown")
        assert self.code == 0
        assert not self.staging.exists()
        with pytest.raises(RunGone):
            self.owner()

    def close(self) -> None:
        if not self.torn_down:
            self.supervisor.request_teardown("test over")
            self.thread.join(10)


@pytest.fixture
def harness(tmp_path):
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(tmp_path / str(len(made)), **kwargs) if made else Harness(tmp_path, **kwargs)
        made.append(h)
        return h

    for path in [tmp_path / str(i) for i in range(1, 3)]:
        path.mkdir()
    yield make
    for h in made:
        h.close()


def stays_up(h: Harness, seconds: float) -> bool:
    h.thread.join(seconds)
    return not h.torn_down


# -- the address -----------------------------------------------------------------------------------


def test_the_address_is_published_privately(harness):
    h = harness(durable=True, reattach=5)
    path = h.staging / ADDRESS_FILE
    socket_path = h.staging / "lifeline.sock"  # loopback: a unix socket in the private staging dir
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert json.loads(path.read_text()) == {
        "host": f"unix:{socket_path}",
        "port": 0,
        "pid": os.getpid(),
        "start_ticks": process_start_ticks(os.getpid()),
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert query_status(h.host, h.port, RUN, SECRET).state == "running"


# -- losing the owner ------------------------------------------------------------------------------


def test_a_non_durable_run_that_loses_its_task_is_torn_down_at_once(harness):
    h = harness(durable=False, reattach=30)
    h.supervisor.state.add_line("training")
    owner = h.owner()
    owner.close()  # the task died: no detach, no release
    h.wait_torn_down(timeout=3)
    assert h.run.killed.is_set()


def test_a_silent_task_counts_as_lost(harness):
    h = harness(durable=False, reattach=30)
    owner = h.owner(pings=False)  # connected, but says nothing: a frozen task
    started = time.monotonic()
    h.wait_torn_down()
    assert SILENCE * 0.9 <= time.monotonic() - started < SILENCE + 3
    assert h.run.killed.is_set()
    owner.close()


def test_a_durable_run_waits_for_its_next_owner_who_picks_up_the_log(harness):
    h = harness(durable=True, reattach=30)
    state = h.supervisor.state
    first = h.owner()
    state.add_line("before")
    assert next(first.events()) == LineEvent(1, "before")
    first.close()  # lost
    assert stays_up(h, SILENCE * 2)
    state.add_line("while nobody owned it")
    with h.owner(since=1) as second:
        events = second.events()
        assert next(events) == LineEvent(2, "while nobody owned it")
        h.succeed({"acc": 1.0})
        done = next(events)
        assert isinstance(done, DoneEvent) and done.status.state == "succeeded"
        assert done.status.metrics == [{"rank": 0, "loss": 0.1}]
        dest = h.staging.parent / "dest"
        dest.mkdir()
        assert read_output(second.fetch_output(dest)) == {"acc": 1.0}
        second.release()
    h.wait_torn_down()
    assert not h.run.killed.is_set()  # it ended by itself


def test_a_durable_run_nobody_comes_back_to_is_torn_down_after_reattach_timeout(harness):
    # The first owner has this long from listen() too: long enough for a loaded machine to attach.
    h = harness(durable=True, reattach=2.0)
    owner = h.owner()
    assert owner.status.state == "running"
    owner.close()
    started = time.monotonic()
    h.wait_torn_down()
    assert 1.6 < time.monotonic() - started < 6
    assert h.run.killed.is_set()


def test_a_lost_trigger_is_waited_for_even_when_not_durable(harness):
    h = harness(durable=False, reattach=2.0)
    h.owner(kind="trigger").close()
    assert stays_up(h, 1.0)
    h.wait_torn_down()


def test_detach_waits_for_the_next_owner(harness):
    h = harness(durable=False, reattach=2.0)
    task = h.owner()
    task.detach()
    task.close()
    assert stays_up(h, 0.3)
    trigger = h.owner(kind="trigger")  # in time: it owns the run now
    assert stays_up(h, 2.5)  # past the detach's deadline
    trigger.close()
    h.wait_torn_down()


def test_a_run_without_any_owner_is_not_kept(harness):
    """The task died between starting the supervisor and connecting: a non-durable run goes soon."""
    h = harness(durable=False, reattach=30)
    h.wait_torn_down(timeout=SILENCE + 3)


def test_an_ended_run_keeps_its_output_for_reattach_timeout_after_losing_its_task(harness):
    # A window wide enough for a loaded machine's retry to connect and fetch within it (it was 1 s).
    h = harness(durable=False, reattach=4.0)
    owner = h.owner()
    h.succeed()
    assert isinstance(list(owner.events())[-1], DoneEvent)
    owner.close()  # without release: the output is kept for a retry
    assert stays_up(h, 0.5)
    with h.owner() as retry:
        assert retry.status.state == "succeeded"
        assert read_output(retry.fetch_output(h.staging.parent)) == 42
    assert stays_up(h, 0.5)
    h.wait_torn_down(timeout=10.0)


# -- the verdict once the driver's outcome is out ----------------------------------------------------


def _outcome_out(h: Harness, value: Any = 42) -> None:
    """What the driver does before its SparkContext stops; spark-submit runs on."""
    publish_value(value, h.staging)
    Outcome(ok=True).write(h.staging)


@pytest.mark.timeout(20)  # without the early verdict, events() waits for a spark-submit that never ends
def test_the_owner_gets_the_verdict_and_output_while_spark_stops(harness):
    h = harness(durable=False, reattach=30)
    owner = h.owner()
    _outcome_out(h)
    done = list(owner.events())[-1]  # spark-submit has not ended
    assert isinstance(done, DoneEvent) and done.status.state == "succeeded"
    assert read_output(owner.fetch_output(h.staging.parent)) == 42
    owner.release()
    owner.close()
    # The release tears down, but the stopping application is let end by itself, not killed.
    assert stays_up(h, 0.3)
    assert not h.run.killed.is_set()
    h.run.end()
    h.wait_torn_down()
    assert not h.run.killed.is_set()


def test_the_drivers_last_lines_are_in_before_the_owner_gets_done(tmp_path, monkeypatch):
    """The follower is drained (the driver closed its channel before the outcome) before "done"."""
    stops: list[bool] = []

    class Follower:
        def stop(self) -> None:
            stops.append(supervisor.state.ended)

    def start_follower(self: RunSupervisor) -> None:
        self._follower = Follower()

    monkeypatch.setattr(RunSupervisor, "_start_follower", start_follower)
    staging = tmp_path / "torchdist-run"
    staging.mkdir()
    config = SupervisorConfig(RUN, False, 30, "127.0.0.1", None, SECRET, staging / "output.pkl", 0.0)
    run = FakeRun()
    supervisor = RunSupervisor(staging, config, make_run=lambda: run, silence_s=SILENCE, ping_interval=0.05)
    host, port = supervisor.listen()
    threading.Thread(target=supervisor.serve, daemon=True).start()
    with OwnerConnection(host, port, RUN, SECRET, kind="task", ping_interval=0.05) as owner:
        publish_value(42, staging)
        Outcome(ok=True).write(staging)
        assert isinstance(list(owner.events())[-1], DoneEvent)
        assert stops[:1] == [False]  # drained while the run had not ended
        owner.release()
    run.end()
    wait_until(lambda: not staging.exists(), 10, "the teardown")


@pytest.mark.parametrize("output", [False, True], ids=["failed ranks", "output without its manifest"])
def test_any_other_verdict_waits_for_spark_submits_end(harness, output):
    """A failed run's cancelled ranks may still be going; an output's manifest may be on its way."""
    h = harness(durable=True, reattach=30)
    if output:
        Outcome(ok=True).write(h.staging)  # rank 0's output is not in
    else:
        failure = RankFailure(rank=1, host="h", exc_type="ValueError", message="bad", traceback="tb")
        Outcome(ok=False, failures=[failure], error="rank 1 failed").write(h.staging)
    time.sleep(0.3)  # several looks at the outcome: none may give a verdict
    assert not h.supervisor.state.ended
    h.run.end()
    assert final_status(h).state == "failed"


def test_an_unreadable_outcome_waits_for_spark_submits_end(harness):
    h = harness(durable=True, reattach=30)
    (h.staging / "outcome.json").write_text("{not json")
    time.sleep(0.3)  # several looks at the file: none may give a verdict
    assert not h.supervisor.state.ended
    h.run.end(raises="Cannot execute: spark-submit. Error code is: 1.")
    status = final_status(h)
    assert status.state == "failed" and status.error.startswith(
        "The Spark application ended before the training driver reported an outcome"
    )


@pytest.mark.timeout(20)
def test_an_application_that_hangs_in_its_stop_is_killed_after_a_while(harness, monkeypatch):
    from airflow_provider_torchdist.supervision import run_supervisor

    monkeypatch.setattr(run_supervisor, "STOPPING_AFTER_OUTCOME_S", 0.3)
    h = harness(durable=False, reattach=30)
    with h.owner() as owner:
        _outcome_out(h)
        assert list(owner.events())[-1].status.state == "succeeded"
        owner.release()
    h.wait_torn_down()
    assert h.run.killed.is_set()


# -- commands --------------------------------------------------------------------------------------


def test_stop_fails_the_run_and_tears_it_down(harness):
    h = harness(durable=True, reattach=30)
    with h.owner() as owner:
        owner.stop()
        done = list(owner.events())[-1]
    assert isinstance(done, DoneEvent)
    assert (done.status.state, done.status.error) == ("failed", "stopped by its owner")
    h.wait_torn_down()
    assert h.run.killed.is_set()


def test_release_is_refused_while_the_run_trains(harness):
    h = harness(durable=True, reattach=30)
    with h.owner() as owner:
        owner.release()
        events = owner.events()
        refusal = next(events)
        assert (
            isinstance(refusal, ErrorEvent)
            and "still running: release is for a run that has ended" in refusal.message
        )
        assert stays_up(h, 0.3)
        h.succeed()
        assert isinstance(next(events), DoneEvent)
        owner.release()
        h.wait_torn_down()


def test_a_new_owner_replaces_the_old_one(harness):
    h = harness(durable=False, reattach=30)
    old = h.owner()
    new = h.owner(kind="trigger")
    with pytest.raises(LifelineError, match="another owner \\(trigger, from pid \\d+\\) took run run-1 over"):
        list(old.events())
    old.close()
    assert stays_up(h, SILENCE)  # the replaced task's loss is not the run's
    new.stop()
    new.close()
    h.wait_torn_down()


def test_a_teardown_request_ends_a_training_run(harness):
    h = harness(durable=True, reattach=30)
    owner = h.owner()
    h.supervisor.request_teardown("the supervisor got SIGTERM")
    done = list(owner.events())[-1]
    assert done.status.error == "The run was torn down before it ended: the supervisor got SIGTERM"
    h.wait_torn_down()
    owner.close()


# -- verdicts --------------------------------------------------------------------------------------


def final_status(h: Harness):
    with h.owner() as owner:
        return [e for e in owner.events() if isinstance(e, DoneEvent)][0].status


def test_failed_ranks_are_the_verdict(harness):
    h = harness(durable=True, reattach=30)
    failure = RankFailure(rank=1, host="h", exc_type="ValueError", message="bad", traceback="tb")
    Outcome(ok=False, failures=[failure], error="Spark lost an executor").write(h.staging)
    h.run.end(raises="Cannot execute: spark-submit. Error code is: 1.")
    status = final_status(h)
    assert (status.state, status.error) == ("failed", "Spark lost an executor")
    assert [RankFailure(**f) for f in status.failures] == [failure]
    assert status.output is None


def test_no_outcome_means_spark_submits_error(harness):
    h = harness(durable=True, reattach=30)
    h.run.end(raises="Cannot execute: spark-submit. Error code is: 1.")
    status = final_status(h)
    assert status.state == "failed"
    assert status.error == (
        "The Spark application ended before the training driver reported an outcome: "
        "Cannot execute: spark-submit. Error code is: 1."
    )


def test_a_callable_without_output_failed(harness):
    h = harness(durable=True, reattach=30)
    Outcome(ok=True).write(h.staging)
    h.run.end()
    status = final_status(h)
    assert (status.state, status.error) == (
        "failed",
        "Training succeeded but rank 0's return value never reached the driver.",
    )


def test_a_script_succeeds_without_output(harness):
    h = harness(durable=True, reattach=30, output=False)
    Outcome(ok=True).write(h.staging)
    h.run.end()
    status = final_status(h)
    assert (status.state, status.output) == ("succeeded", None)


def test_a_plan_that_cannot_run_fails_the_run(tmp_path):
    staging = tmp_path / "torchdist-x"
    staging.mkdir()
    config = SupervisorConfig(RUN, True, 30.0, "127.0.0.1", None, SECRET, None, 0.0)

    def broken() -> FakeRun:
        raise ValueError("plan.json must hold exactly [...]")

    supervisor = RunSupervisor(staging, config, make_run=broken, follow=False)
    host, port = supervisor.listen()
    thread = threading.Thread(target=supervisor.serve, daemon=True)
    thread.start()
    with OwnerConnection(host, port, RUN, SECRET) as owner:
        done = list(owner.events())[-1]
        assert (
            done.status.error
            == "The run's supervisor could not start spark-submit: plan.json must hold exactly [...]"
        )
        owner.release()
    thread.join(5)
    assert not thread.is_alive() and not staging.exists()


# -- settings and the lock -------------------------------------------------------------------------

GOOD = {
    "run_id": RUN,
    "durable": True,
    "reattach_timeout": 600.0,
    "bind_host": "127.0.0.1",
    "checkpoint_dir": None,
    "owner_secret_hex": SECRET.hex(),
    "output_file": "/tmp/x/output.pkl",
    "stop_grace_period": 30.0,
}


def test_settings_are_read_strictly():
    config = SupervisorConfig.from_dict(GOOD)
    assert config.owner_secret == SECRET and config.output_file == Path("/tmp/x/output.pkl")
    for bad, what in [
        ({"durable": 1}, "durable"),
        ({"reattach_timeout": True}, "reattach_timeout"),
        ({"reattach_timeout": float("inf")}, "reattach_timeout"),
        ({"owner_secret_hex": "ab" * 8}, "owner_secret_hex"),
        ({"owner_secret_hex": "zz"}, "owner_secret_hex"),
        ({"output_file": "relative.pkl"}, "output_file"),
        ({"checkpoint_dir": ""}, "checkpoint_dir"),
        ({"run_id": ""}, "run_id"),
    ]:
        with pytest.raises(SupervisorStartError, match=f"bad {what}"):
            SupervisorConfig.from_dict({**GOOD, **bad})
    with pytest.raises(SupervisorStartError, match="must hold exactly"):
        SupervisorConfig.from_dict({k: v for k, v in GOOD.items() if k != "output_file"})


def test_settings_files_must_be_private(tmp_path):
    path = tmp_path / SUPERVISOR_FILE
    path.write_text(json.dumps(GOOD))
    path.chmod(0o644)
    with pytest.raises(SupervisorStartError, match="private \\(0600\\)"):
        read_private(path)
    path.chmod(0o600)
    assert SupervisorConfig.read(tmp_path).run_id == RUN


def test_the_lock_admits_one_live_run_per_checkpoint_dir(tmp_path):
    checkpoints = tmp_path / "ckpt" / "task"
    first = RunLock.acquire(str(checkpoints))
    assert stat.S_IMODE(checkpoints.stat().st_mode) == 0o700
    with pytest.raises(
        RunLocked, match=f"another run of this task is live \\(it holds .*{LOCK_FILE}, pid {os.getpid()}\\)"
    ):
        RunLock.acquire(f"file://{checkpoints}")
    first.release()
    second = RunLock.acquire(str(checkpoints))
    second.release()
    assert (checkpoints / LOCK_FILE).exists()  # never deleted


def test_a_run_being_torn_down_is_waited_for_and_a_live_one_is_not(tmp_path):
    """A cleared task's new try starts its run while the old run's teardown still holds the lock
    (its lifeline stopped answering first): it waits for that lock, not for a live run's."""
    checkpoints = tmp_path / "ckpt"
    old = RunLock.acquire(str(checkpoints))
    started = time.monotonic()
    with pytest.raises(RunLocked, match="another run of this task is live"):
        RunLock.acquire(str(checkpoints), ending_wait=5.0)
    assert time.monotonic() - started < 1.0  # a live run: refused at once, not after the wait

    old.mark_ending()
    threading.Timer(0.5, old.release).start()
    new = RunLock.acquire(str(checkpoints), ending_wait=5.0)
    assert 0.4 < time.monotonic() - started < 5.0
    assert (checkpoints / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    new.release()

    from airflow_provider_torchdist.supervision.lock import ENDING_WAIT_S
    from airflow_provider_torchdist.supervision.task_side import START_TIMEOUT_S

    assert ENDING_WAIT_S + 10 < START_TIMEOUT_S  # the task hears RunLocked, not "never listened"
    stuck = RunLock.acquire(str(checkpoints))
    stuck.mark_ending()
    with pytest.raises(RunLocked, match="still ending after 0 s"):
        RunLock.acquire(str(checkpoints), ending_wait=0.3)
    stuck.release()


def test_a_run_in_its_grace_period_is_waited_for_until_it_said_it_would_be_gone(tmp_path):
    """A stopped run's ranks get ``stop_grace_period`` to checkpoint: its lock says until when, and
    the next run waits that long (beyond ``ending_wait``), telling whoever started it once."""
    checkpoints = tmp_path / "ckpt"
    old = RunLock.acquire(str(checkpoints))
    until = time.time() + 1.5
    old.mark_ending(until)
    assert (checkpoints / LOCK_FILE).read_text() == f"{os.getpid()} ending {until:.0f}\n"
    threading.Timer(1.0, old.release).start()
    heard: list[float] = []
    started = time.monotonic()
    new = RunLock.acquire(str(checkpoints), ending_wait=0.2, on_wait=heard.append)
    assert 0.9 < time.monotonic() - started < 5.0  # past ending_wait: the holder said 1.5 s
    assert heard == [float(f"{until:.0f}")]
    new.release()

    gone_by_now = RunLock.acquire(str(checkpoints))
    gone_by_now.mark_ending(time.time() - 1)  # said it would be gone, and is not: refused
    with pytest.raises(RunLocked, match="still ending"):
        RunLock.acquire(str(checkpoints), ending_wait=30.0)
    gone_by_now.release()


def test_the_task_waits_for_a_supervisor_that_waits_for_an_earlier_runs_stop(tmp_path):
    from airflow_provider_torchdist.supervision.config import LOCK_WAIT_FILE
    from airflow_provider_torchdist.supervision.task_side import START_TIMEOUT_S, _lock_wait_deadline

    assert _lock_wait_deadline(tmp_path) == 0.0  # no such wait
    (tmp_path / LOCK_WAIT_FILE).write_text(json.dumps({"until": time.time() + 100}))
    left = _lock_wait_deadline(tmp_path) - time.monotonic()
    assert 99 + START_TIMEOUT_S < left < 101 + START_TIMEOUT_S
    for bad in ('{"until": "soon"}', '{"until": NaN}', "[]", "{"):
        (tmp_path / LOCK_WAIT_FILE).write_text(bad)
        assert _lock_wait_deadline(tmp_path) == 0.0


# -- the real process ------------------------------------------------------------------------------

#: spark-submit that notes its PID beside the spec (the last argument) and trains "forever".
HANGING_SPARK_SUBMIT = (
    '#!/bin/sh\nfor a; do last="$a"; done\nd="$(dirname "$last")"\n'
    # Written whole, then renamed: the test must never read a half-written file.
    'echo $$ > "$d/fake.pid.tmp" && mv "$d/fake.pid.tmp" "$d/fake.pid"\nexec sleep 300\n'
)
#: spark-submit that plays a succeeding driver: rank 0's value 42 and an ok outcome.
SUCCEEDING_SPARK_SUBMIT = f"""#!{sys.executable}
import os, sys
from dataclasses import dataclass
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parents[3])!r})
from tests.unit.conftest import publish_value
from airflow_provider_torchdist.spark.wire.outcome import Outcome
staging = Path(sys.argv[-1]).parent
publish_value(42, staging)
Outcome(ok=True).write(staging)
(staging / "fake.pid.tmp").write_text(str(os.getpid()))
os.replace(staging / "fake.pid.tmp", staging / "fake.pid")  # whole: the test reads it once it exists
"""


def stage_supervised_run(
    tmp_path: Path, name: str, fake: str, checkpoint_dir: Path | None, grace: float = 0.0
) -> Path:
    """A staging directory as the hook leaves it for the supervisor: plan.json and supervisor.json."""
    bin_dir = tmp_path / f"bin-{name}"
    bin_dir.mkdir()
    (bin_dir / "spark-submit").write_text(fake)
    (bin_dir / "spark-submit").chmod(0o755)
    staging = tmp_path / f"torchdist-{name}"
    staging.mkdir(mode=0o700)
    target = SparkTarget(
        master="local[2]", connection={"conn_type": "spark", "host": "local[2]"}, embedded=True
    )
    plan = build_plan(
        build_spec(),
        target,
        application=str(staging / "torchdist_driver.py"),
        application_args=[str(staging / "spec.json")],
        files=[],
        py_files=[],
        properties={"spark.app.name": "test"},
        properties_dir=staging,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    config = {
        **GOOD,
        "run_id": name,
        "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir),
        "output_file": str(staging / "output.pkl"),
        "stop_grace_period": grace,
    }
    for file, text in ((PLAN_FILE, plan.to_json()), (SUPERVISOR_FILE, json.dumps(config))):
        fd = os.open(staging / file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return staging


def start_supervisor(staging: Path) -> tuple[subprocess.Popen, float]:
    """The supervisor as the hook starts it; no Airflow metadata DB it could use (the path does not exist)."""
    env = {
        **os.environ,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "sqlite:////nonexistent-torchdist-dir/airflow.db",
    }
    started = time.monotonic()
    process = start_detached(
        [sys.executable, "-m", "airflow_provider_torchdist.supervision.supervisor", str(staging)],
        env=env,
        log=staging.parent / f"{staging.name}.log",
    )
    return process, started


def address_of(staging: Path, process: subprocess.Popen, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads((staging / ADDRESS_FILE).read_text())
        except (OSError, ValueError):
            assert process.poll() is None, (staging.parent / f"{staging.name}.log").read_text()
            time.sleep(0.005)
    pytest.fail("the supervisor did not write its address")


def test_the_detached_supervisor_runs_spark_submit_and_stop_ends_all_of_it(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    staging = stage_supervised_run(tmp_path, "stop", HANGING_SPARK_SUBMIT, checkpoints)
    process, started = start_supervisor(staging)
    try:
        address = address_of(staging, process)
        listening = time.monotonic() - started
        assert address["pid"] == process.pid
        wait_until(lambda: (staging / "fake.pid").exists(), 30, "spark-submit to start")
        submitting = time.monotonic() - started
        fake = psutil.Process(int((staging / "fake.pid").read_text()))
        assert os.getsid(fake.pid) == fake.pid != process.pid  # spark-submit in its own session

        # A second run of the same task (same checkpoint_dir) fails at once, saying why.
        second = stage_supervised_run(tmp_path, "second", HANGING_SPARK_SUBMIT, checkpoints)
        other, _ = start_supervisor(second)
        assert other.wait(30) == EXIT_LOCKED
        error = (second / ERROR_FILE).read_text()
        assert (
            f"another run of this task is live (it holds {checkpoints / LOCK_FILE}, pid {process.pid})"
            in error
        )
        assert stat.S_IMODE((second / ERROR_FILE).stat().st_mode) == 0o600

        with OwnerConnection(address["host"], address["port"], "stop", SECRET) as owner:
            assert owner.status.state == "running"
            owner.stop()
            done = list(owner.events())[-1]
        assert done.status.error == "stopped by its owner"
        assert process.wait(30) == 0
        assert not is_alive(fake.pid)
        assert not staging.exists()
        assert (checkpoints / LOCK_FILE).exists()
        print(f"supervisor: listening after {listening:.3f} s, spark-submit started after {submitting:.3f} s")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(staging, ignore_errors=True)


#: spark-submit that plays a driver whose ranks honour a stop request: it waits for
#: ``stop-request.json`` (what the run channel polls for), "checkpoints" and ends; IGNORING never ends.
STOPPABLE_SPARK_SUBMIT = f"""#!{sys.executable}
import json, os, sys, time
from dataclasses import dataclass
from pathlib import Path
staging = Path(sys.argv[-1]).parent
(staging / "fake.pid.tmp").write_text(str(os.getpid()))
os.replace(staging / "fake.pid.tmp", staging / "fake.pid")  # whole: the test reads it once it exists
# As a driver does once its run channel listens (no one answers there: the log is not followed).
(staging / "channel.json").write_text('{{"host": "127.0.0.1", "port": 9}}')
while not (staging / "stop-request.json").exists():
    time.sleep(0.05)
request = json.loads((staging / "stop-request.json").read_text())
time.sleep(0.5)  # the checkpoint
(staging.parent / "checkpointed.json").write_text(json.dumps(request))
"""
IGNORING_SPARK_SUBMIT = STOPPABLE_SPARK_SUBMIT.replace("time.sleep(0.5)", "time.sleep(300)")
#: A driver whose ranks all answered that they do not watch for stops: it says so, and trains on.
DECLINING_SPARK_SUBMIT = STOPPABLE_SPARK_SUBMIT.replace(
    "time.sleep(0.5)", '(staging / "stop-declined").write_text("2"); time.sleep(300)'
)


@dataclass
class Stopped:
    """How a stop of a detached supervisor's run went, as its owner saw it."""

    lines: list[str]
    status: Any
    seconds: float  # from the stop to the run's final status
    fake_pid: int
    exit_code: int


def stop_a_supervised_run(tmp_path: Path, fake: str, grace: float, why: str) -> Stopped:
    """Start a detached supervisor on ``fake`` spark-submit, stop the run once it runs (``why``),
    follow it to its end; the supervisor must exit cleanly and leave no staging directory."""
    staging = stage_supervised_run(tmp_path, "stopped", fake, None, grace=grace)
    process, _ = start_supervisor(staging)
    try:
        address = address_of(staging, process)
        wait_until(lambda: (staging / "fake.pid").exists(), 30, "spark-submit to start")
        fake_pid = int((staging / "fake.pid").read_text())
        with OwnerConnection(address["host"], address["port"], "stopped", SECRET) as owner:
            owner.stop(why)
            started = time.monotonic()
            events = list(owner.events())
            seconds = time.monotonic() - started
        code = process.wait(30)
        assert not staging.exists()
        lines = [e.text for e in events if isinstance(e, LineEvent)]
        return Stopped(lines, events[-1].status, seconds, fake_pid, code)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("honoured", [True, False], ids=["ranks-checkpoint", "ranks-ignore-it"])
def test_a_stop_gives_the_run_its_grace_period_and_the_owner_sees_how_it_went(tmp_path, honoured):
    """A stop with ``stop_grace_period=4``: the request reaches the run (its staging directory) with
    the owner's reason; a run that ends by itself is not killed, one that does not is killed when
    the grace period runs out."""
    fake = STOPPABLE_SPARK_SUBMIT if honoured else IGNORING_SPARK_SUBMIT
    stopped = stop_a_supervised_run(tmp_path, fake, 4.0, "timeout")
    assert "[torchdist] stop requested (timeout): ranks have 4 s to checkpoint" in stopped.lines
    if honoured:
        assert json.loads((tmp_path / "checkpointed.json").read_text()) == {
            "k": "stop",
            "reason": "timeout",
            "grace": 4.0,
        }
        assert any(line.startswith("[torchdist] the run ended ") for line in stopped.lines), stopped.lines
        assert stopped.status.error.startswith("stopped by its owner (timeout); the ranks ended ")
        assert stopped.seconds < 4.0  # not held to the grace period
    else:
        assert (
            "[torchdist] the ranks did not end within the 4 s grace period: the run is killed"
            in stopped.lines
        )
        assert stopped.status.error == (
            "stopped by its owner (timeout); the ranks had 4 s to checkpoint and were killed when it ran out"
        )
        assert 3.9 < stopped.seconds < 15
    assert stopped.exit_code == 0 and not is_alive(stopped.fake_pid)


def test_a_run_whose_ranks_do_not_watch_for_stops_is_not_held_to_the_grace_period(tmp_path):
    stopped = stop_a_supervised_run(tmp_path, DECLINING_SPARK_SUBMIT, 60.0, "timeout")
    assert stopped.seconds < 15  # not the 60 s grace period
    assert stopped.status.error == (
        "stopped by its owner (timeout); no rank's code watches for stops, so it was ended without a "
        "grace period"
    )
    assert stopped.exit_code == 0 and not is_alive(stopped.fake_pid)


def test_a_run_stopped_before_its_driver_started_any_rank_is_not_held_to_the_grace_period(tmp_path):
    stopped = stop_a_supervised_run(tmp_path, HANGING_SPARK_SUBMIT, 60.0, "killed")
    assert stopped.seconds < 15
    assert stopped.status.error.endswith(
        "; it had not started training, so it was ended without a grace period"
    )
    assert not any("stop requested" in line for line in stopped.lines)
    assert stopped.exit_code == 0 and not is_alive(stopped.fake_pid)


def test_a_run_without_a_grace_period_is_killed_at_once(tmp_path):
    stopped = stop_a_supervised_run(tmp_path, IGNORING_SPARK_SUBMIT, 0.0, "killed")
    assert not any("stop requested" in line for line in stopped.lines)
    assert stopped.status.error == "stopped by its owner (killed)"
    assert not (tmp_path / "checkpointed.json").exists()
    assert stopped.exit_code == 0 and not is_alive(stopped.fake_pid)


def test_the_detached_supervisor_hands_over_the_output_then_goes(tmp_path):
    staging = stage_supervised_run(tmp_path, "output", SUCCEEDING_SPARK_SUBMIT, None)
    process, _ = start_supervisor(staging)
    try:
        address = address_of(staging, process)
        with OwnerConnection(address["host"], address["port"], "output", SECRET) as owner:
            done = list(owner.events())[-1]
            assert done.status.state == "succeeded", done.status.error
            dest = tmp_path / "dest"
            dest.mkdir()
            assert read_output(owner.fetch_output(dest)) == 42
            owner.release()
        assert process.wait(30) == 0
        assert not staging.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_tears_the_detached_supervisor_down(tmp_path):
    staging = stage_supervised_run(tmp_path, "sigterm", HANGING_SPARK_SUBMIT, None)
    process, _ = start_supervisor(staging)
    try:
        address_of(staging, process)
        wait_until(lambda: (staging / "fake.pid").exists(), 30, "spark-submit to start")
        fake = int((staging / "fake.pid").read_text())
        process.terminate()
        assert process.wait(30) == 0
        assert not is_alive(fake)
        assert not staging.exists()
        log = (tmp_path / "torchdist-sigterm.log").read_text()
        assert "tearing down: the supervisor got SIGTERM" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_supervisors_log_lines_reach_its_owners_escaped_without_the_drivers_own() -> None:
    import structlog

    from airflow_provider_torchdist.supervision.submission import forward_logs

    saved = structlog.get_config()
    lines: list[str] = []
    try:
        forward_logs(lines.append)
        log = structlog.get_logger("airflow.providers.apache.spark.hooks.spark_submit.SparkSubmitHook")
        log.info("Exception in thread main: bad \x1b[2J conf")
        log.info("[torchdist] training finished on all ranks")  # on the run channel already
    finally:
        structlog.configure(**saved)
    assert lines == ["Exception in thread main: bad \\x1b[2J conf"]


def test_the_supervisor_starts_without_importing_airflow() -> None:
    """Airflow (3 s of imports under load) comes with the Spark provider, when the submission is
    made; the supervisor's address must not wait for it (it once did, through lifeline.status ->
    submit.validation -> errors)."""
    import subprocess

    code = (
        "import sys, airflow_provider_torchdist.supervision.supervisor; "
        "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_plan_without_an_optional_field_is_taken_and_one_with_an_unknown_field_is_not(tmp_path):
    """A plan.json of a release before ``jvm_archive`` runs; one with a field nobody knows does not."""
    from airflow_provider_torchdist.submit.spark_submit import Submission
    from airflow_provider_torchdist.supervision.submission import submission_of

    staging = stage_supervised_run(tmp_path, "plan", "#!/bin/sh\nexit 0\n", None)
    plan = json.loads((staging / PLAN_FILE).read_text())
    older = {k: v for k, v in plan.items() if k != "jvm_archive"}
    assert isinstance(submission_of(staging, json.dumps(older)), Submission)
    with pytest.raises(ValueError, match="must hold"):
        submission_of(staging, json.dumps({**plan, "surprise": 1}))
    with pytest.raises(ValueError, match="must hold"):
        submission_of(staging, json.dumps({k: v for k, v in plan.items() if k != "application"}))
