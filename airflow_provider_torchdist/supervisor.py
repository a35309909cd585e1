"""The run's supervisor: ``python -m airflow_provider_torchdist.supervisor <staging_dir>``.

The task stages a run and starts this process detached (own session, stdin /dev/null, no inherited
descriptors: :func:`~airflow_provider_torchdist.processes.start_detached`), so the run no longer
lives and dies with the task. It reads ``<staging>/supervisor.json`` (0600)::

    {"run_id", "durable", "reattach_timeout", "bind_host", "checkpoint_dir", "owner_secret_hex",
     "output_file"}

and ``<staging>/plan.json`` (``SubmitPlan.to_json()``), then:

1. takes ``<checkpoint_dir>/.torchdist-run.lock`` (``flock``, for its whole life): a second live run
   of the same task fails at once (``supervisor.error``, exit code 3);
2. sweeps what dead runs left in the temp directory (:mod:`~airflow_provider_torchdist.sweep`), in
   the background;
3. listens for owners (:mod:`~airflow_provider_torchdist.lifeline`) and writes
   ``<staging>/supervisor.addr`` = ``{"host", "port", "pid"}`` (atomic, 0600);
4. runs spark-submit (:class:`~airflow_provider_torchdist.submit_plan.Submission`) and follows the
   driver (:class:`~airflow_provider_torchdist.run_follower.RunFollower`), keeping the last log
   lines, the application and the metrics for its owners;
5. when spark-submit ends, reads the outcome and keeps rank 0's output until an owner releases it.

**Owners.** At most one at a time: a new authenticated owner replaces the old one. An owner is
lost when its connection closes, or it is silent for ``OWNER_SILENCE_S``, without ``detach`` or
``release`` first. A run still training that loses a ``task`` owner and is not ``durable`` is torn
down at once; otherwise (a durable run, a trigger, a ``detach``, a run that has ended) the
supervisor waits ``reattach_timeout`` for the next owner, then tears down. ``stop`` tears down now;
``release`` tears an ended run down. Before its first owner, a run waits as after a loss (the task
connects right after the address appears).

**Teardown** (:meth:`RunSupervisor.teardown`, also on SIGTERM and SIGINT): stop spark-submit, end
every process of its session, stop following, close the lifeline, remove the staging directory,
release the lock, exit 0.

Start failures (before the address is written) go to ``<staging>/supervisor.error``, exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from airflow_provider_torchdist.lifeline import (
    OWNER_SILENCE_S,
    PING_INTERVAL_S,
    LifelineServer,
    OwnerSession,
    RunState,
)
from airflow_provider_torchdist.properties import write_private_text
from airflow_provider_torchdist.sweep import ADDRESS_FILE, SUPERVISOR_FILE, sweep_stale

PLAN_FILE = "plan.json"
ERROR_FILE = "supervisor.error"
LOG_FILE = "supervisor.log"
LOCK_FILE = ".torchdist-run.lock"
EXIT_OK = 0
EXIT_START_FAILED = 2
EXIT_LOCKED = 3
#: How long teardown waits for spark-submit's thread once its session is being ended.
KILL_WAIT_S = 30.0
STOPPED_BY_OWNER = "stopped by its owner"

__all__ = [
    "ADDRESS_FILE",
    "ERROR_FILE",
    "EXIT_LOCKED",
    "EXIT_START_FAILED",
    "LOCK_FILE",
    "LOG_FILE",
    "PLAN_FILE",
    "SUPERVISOR_FILE",
    "RunLock",
    "RunLocked",
    "RunProcess",
    "RunSupervisor",
    "SupervisorConfig",
    "SupervisorStartError",
    "main",
]


class SupervisorStartError(Exception):
    """The supervisor cannot start the run; the text goes to ``supervisor.error``."""

    exit_code = EXIT_START_FAILED


class RunLocked(SupervisorStartError):
    """Another live run of the same task holds the checkpoint directory's lock."""

    exit_code = EXIT_LOCKED


def log(message: str) -> None:
    """One line of the supervisor's own log (its stdout is ``supervisor.log``)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} [torchdist supervisor] {message}", flush=True)


# -- the settings ---------------------------------------------------------------------------------


def read_private(path: Path) -> str:
    """A file only this user can read or write: what the task handed over in it is secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SupervisorStartError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise SupervisorStartError(
                f"{path} must belong to this user (uid {os.getuid()}) and be private (0600); it is uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
            )
        return f.read()


@dataclass(frozen=True)
class SupervisorConfig:
    """``supervisor.json``: what the task hands its run's supervisor."""

    run_id: str
    durable: bool
    reattach_timeout: float
    bind_host: str
    checkpoint_dir: str | None
    owner_secret: bytes
    #: Rank 0's output file (in the staging directory); None for a script.
    output_file: Path | None

    @classmethod
    def from_dict(cls, data: Any) -> SupervisorConfig:
        keys = {
            "run_id",
            "durable",
            "reattach_timeout",
            "bind_host",
            "checkpoint_dir",
            "owner_secret_hex",
            "output_file",
        }
        if not isinstance(data, dict) or set(data) != keys:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise SupervisorStartError(f"{SUPERVISOR_FILE} must hold exactly {sorted(keys)}, got {got}")
        timeout = data["reattach_timeout"]
        try:
            secret = (
                bytes.fromhex(data["owner_secret_hex"]) if isinstance(data["owner_secret_hex"], str) else b""
            )
        except ValueError:
            secret = b""
        problems = [
            name
            for name, ok in (
                ("run_id", isinstance(data["run_id"], str) and 0 < len(data["run_id"]) <= 200),
                ("durable", type(data["durable"]) is bool),
                (
                    "reattach_timeout",
                    type(timeout) in (int, float) and math.isfinite(timeout) and timeout > 0,
                ),
                ("bind_host", isinstance(data["bind_host"], str) and bool(data["bind_host"])),
                (
                    "checkpoint_dir",
                    data["checkpoint_dir"] is None
                    or (isinstance(data["checkpoint_dir"], str) and data["checkpoint_dir"]),
                ),
                ("owner_secret_hex", len(secret) >= 32),
                (
                    "output_file",
                    data["output_file"] is None
                    or (isinstance(data["output_file"], str) and os.path.isabs(data["output_file"])),
                ),
            )
            if not ok
        ]
        if problems:
            raise SupervisorStartError(f"{SUPERVISOR_FILE} has bad {', '.join(problems)}")
        return cls(
            run_id=data["run_id"],
            durable=data["durable"],
            reattach_timeout=float(timeout),
            bind_host=data["bind_host"],
            checkpoint_dir=data["checkpoint_dir"],
            owner_secret=secret,
            output_file=None if data["output_file"] is None else Path(data["output_file"]),
        )

    @classmethod
    def read(cls, staging_dir: Path) -> SupervisorConfig:
        try:
            data = json.loads(read_private(staging_dir / SUPERVISOR_FILE))
        except ValueError as exc:
            raise SupervisorStartError(f"{SUPERVISOR_FILE} is not JSON: {exc}") from None
        return cls.from_dict(data)


def read_plan_text(staging_dir: Path) -> str:
    """``plan.json``, checked to be a private JSON object (the plan itself is built after the
    lifeline listens: importing the Spark provider takes a second)."""
    text = read_private(staging_dir / PLAN_FILE)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SupervisorStartError(f"{PLAN_FILE} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SupervisorStartError(f"{PLAN_FILE} must hold a JSON object, got {type(data).__name__}")
    return text


# -- the lock -------------------------------------------------------------------------------------


class RunLock:
    """``<checkpoint_dir>/.torchdist-run.lock``, held (``flock``) for the supervisor's life.

    The file is never deleted: deleting it would let a second run lock a new file of the same name
    while the first still holds the old one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, checkpoint_dir: str) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the live run that holds it."""
        directory = _local_dir(checkpoint_dir)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            path = Path(directory) / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SupervisorStartError(
                f"cannot create the run lock in checkpoint_dir {checkpoint_dir!r}: {exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"another run of this task is live (it holds {path}, pid {holder}): two runs sharing "
                f"checkpoint_dir {checkpoint_dir!r} would train at once and write the same checkpoints. Let "
                f"that run end (or stop it: its supervisor is pid {holder}), then try again."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


def _local_dir(checkpoint_dir: str) -> str:
    if "://" in checkpoint_dir:  # a file:/// URI: read as the task's checks read it
        from airflow_provider_torchdist.validation import checkpoint_dir_path

        try:
            return checkpoint_dir_path(checkpoint_dir)
        except ValueError as exc:
            raise SupervisorStartError(str(exc)) from None
    if not os.path.isabs(checkpoint_dir):
        raise SupervisorStartError(f"checkpoint_dir {checkpoint_dir!r} is not an absolute path")
    return checkpoint_dir


# -- the run --------------------------------------------------------------------------------------


class RunProcess(Protocol):
    """What the supervisor runs: :class:`~airflow_provider_torchdist.submit_plan.Submission`, or a
    test's stand-in. ``run`` blocks until spark-submit ends (raising when it failed); ``kill`` may
    come from another thread; ``session`` is spark-submit's session id once known."""

    session: int | None

    def run(self) -> None: ...

    def kill(self) -> None: ...


def submission_of(staging_dir: Path, plan_text: str) -> RunProcess:
    """The real run: ``plan.json`` through ``SparkSubmitHook`` (imports the Spark provider)."""
    from airflow_provider_torchdist.submit_plan import Submission, SubmitPlan

    data = json.loads(plan_text)
    names = {f.name for f in dataclasses.fields(SubmitPlan)}
    if set(data) != names:
        raise ValueError(f"{PLAN_FILE} must hold exactly {sorted(names)}, got {sorted(data)}")
    return Submission(SubmitPlan.from_json(plan_text))


class RunSupervisor:
    """The supervisor of one run (see the module docstring), without the process around it.

    ``make_run`` makes what runs (default: the plan's :class:`Submission`); ``follow=False`` skips
    following the driver (a test feeds ``state`` itself). Example::

        supervisor = RunSupervisor(staging, config, make_run=lambda: FakeRun())
        supervisor.listen()          # binds, writes supervisor.addr
        code = supervisor.serve()    # runs it, owns it, tears it down; returns the exit code
    """

    def __init__(
        self,
        staging_dir: Path,
        config: SupervisorConfig,
        *,
        plan_text: str | None = None,
        lock: RunLock | None = None,
        make_run: Callable[[], RunProcess] | None = None,
        follow: bool = True,
        silence_s: float = OWNER_SILENCE_S,
        ping_interval: float = PING_INTERVAL_S,
    ) -> None:
        self.staging_dir = staging_dir
        self.config = config
        self.state = RunState()
        self.server: LifelineServer | None = None
        self.process: RunProcess | None = None
        self._lock_file = lock
        if make_run is None:
            text = plan_text if plan_text is not None else read_plan_text(staging_dir)
            make_run = lambda: submission_of(staging_dir, text)  # noqa: E731
        self._make_run = make_run
        self._follow = follow
        self._follower: Any = None
        self._silence_s, self._ping_interval = silence_s, ping_interval
        self._cond = threading.Condition()
        self._owner: OwnerSession | None = None
        self._deadline: float | None = None
        self._waited = 0.0
        self._reason: str | None = None
        self._run_error: str | None = None
        self._tearing_down = False
        self._run_thread = threading.Thread(target=self._run, name="torchdist-run", daemon=True)

    @property
    def run_id(self) -> str:
        return self.config.run_id

    # -- start

    def listen(self) -> tuple[str, int]:
        """Bind the lifeline and publish its address (``supervisor.addr``); owners may connect now."""
        config = self.config
        self.server = LifelineServer(
            config.run_id,
            config.owner_secret,
            config.bind_host,
            self.state,
            self,
            silence_s=self._silence_s,
            ping_interval=self._ping_interval,
        )
        host, port = self.server.address
        if host in ("0.0.0.0", "::"):  # listening everywhere: owners need a name for this machine
            host = socket.getfqdn()
        write_private_text(
            self.staging_dir / ADDRESS_FILE, json.dumps({"host": host, "port": port, "pid": os.getpid()})
        )
        with self._cond:
            self._wait_for_owner(self._first_owner_wait())
        self.server.start()
        log(f"run {config.run_id}: the lifeline listens on {host}:{port}")
        return host, port

    def _first_owner_wait(self) -> float:
        # The task connects right after the address appears. If it died meanwhile, a run that is
        # not durable must not wait long for it.
        if self.config.durable:
            return self.config.reattach_timeout
        return min(self.config.reattach_timeout, self._silence_s)

    def serve(self) -> int:
        """Run spark-submit and own the run until it is torn down; returns the exit code (0)."""
        if self.server is None:
            self.listen()
        self._run_thread.start()
        with self._cond:
            while self._reason is None:
                now = time.monotonic()
                if self._deadline is not None and now >= self._deadline:
                    self._reason = self._orphan_reason()
                    break
                self._cond.wait(None if self._deadline is None else self._deadline - now)
            reason = self._reason
        self.teardown(reason)
        return EXIT_OK

    def _wait_for_owner(self, seconds: float) -> None:
        """Tear down in ``seconds`` unless an owner attaches (under ``_cond``)."""
        self._deadline, self._waited = time.monotonic() + seconds, seconds

    def _orphan_reason(self) -> str:
        what = "its output was not taken" if self.state.ended else "it had not ended"
        return f"no owner came within {self._waited:g} s and {what}"

    # -- the run

    def _run(self) -> None:
        submit_error: BaseException | None = None
        try:
            if self._follow:
                self._start_follower()
            try:
                process = self._make_run()
            except Exception as exc:
                log(f"cannot start spark-submit: {exc!r}")
                self._finish("failed", error=f"The run's supervisor could not start spark-submit: {exc}")
                return
            with self._cond:
                if self._tearing_down:
                    return
                self.process = process
            self.state.set_running()
            log("spark-submit starts")
            try:
                process.run()
            except Exception as exc:  # AirflowException: spark-submit failed
                submit_error = exc
            log(f"spark-submit ended{f': {submit_error}' if submit_error else ''}")
        finally:
            if self._follower is not None:
                self._follower.stop()
        self._conclude(submit_error)

    def _start_follower(self) -> None:
        from airflow_provider_torchdist.run_follower import RunFollower
        from airflow_provider_torchdist.spark.owner import write_owner_token

        self._follower = RunFollower(
            self.staging_dir,
            write_owner_token(self.staging_dir),
            on_line=self.state.add_line,
            on_application=self.state.set_application,
            on_metric=self.state.add_metric,
        )
        self._follower.start()

    def _conclude(self, submit_error: BaseException | None) -> None:
        """spark-submit has ended: the run's verdict, as ``hook.run()`` would give it."""
        from airflow_provider_torchdist.spark.outcome import Outcome
        from airflow_provider_torchdist.spark.output_store import OutputManifest

        with self._cond:
            if self._tearing_down:
                return  # the teardown ended it, and said why
        try:
            outcome = Outcome.read(self.staging_dir)
        except (OSError, ValueError, TypeError) as exc:
            outcome, submit_error = None, submit_error or exc
        metrics = outcome.metrics if outcome else []
        if outcome is None:
            self._finish(
                "failed",
                error=f"The Spark application ended before the training driver reported an outcome: {submit_error}",
                metrics=metrics,
            )
        elif not outcome.ok:
            failures = [dataclasses.asdict(f) for f in outcome.failures]
            self._finish(
                "failed", error=outcome.error, error_kind="training", failures=failures, metrics=metrics
            )
        elif self.config.output_file is None:
            self._finish("succeeded", metrics=metrics)
        else:
            path = self.config.output_file
            manifest = OutputManifest.read(path)
            if manifest is None:
                error = (
                    f"Training succeeded but rank 0's output at {path} has no valid manifest from the driver; it is not used."
                    if path.exists()
                    else "Training succeeded but rank 0's return value never reached the driver."
                )
                self._finish("failed", error=error, metrics=metrics)
            else:
                output = {
                    "format": manifest.format,
                    "type": manifest.type,
                    "size": manifest.size,
                    "sha256": manifest.sha256,
                }
                self._finish("succeeded", metrics=metrics, output=output, output_path=path)

    def _finish(self, state: str, **details: Any) -> None:
        if self.state.finish(state, **details):
            status = self.state.status()
            summary = "; ".join(filter(None, [status.error, *(_failure_summary(f) for f in status.failures)]))
            log(f"the run {state}{f': {summary}' if summary else ''}")
        with self._cond:
            if self._owner is None and self._deadline is None:
                self._wait_for_owner(self.config.reattach_timeout)
            self._cond.notify_all()

    # -- owners (called by the lifeline's threads)

    def owner_attached(self, owner: OwnerSession) -> None:
        with self._cond:
            if self._reason is not None:
                return  # not an owner any more: it gets the end of the run, then the lifeline closes
            old, self._owner, self._deadline = self._owner, owner, None
        if old is not None:
            old.close(f"another owner ({owner.kind}, from {owner.peer}) took run {self.run_id} over")
        log(f"owner attached: {owner.kind} from {owner.peer}{' (replacing ' + old.kind + ')' if old else ''}")

    def owner_command(self, owner: OwnerSession, command: str) -> str | None:
        with self._cond:
            if owner is not self._owner:
                return f"this lifeline is no longer the owner of run {self.run_id}"
            if command == "stop":
                log(f"stop from its owner ({owner.kind})")
                self._request(STOPPED_BY_OWNER, run_error=STOPPED_BY_OWNER)
            elif command == "detach":
                self._owner = None
                self._wait_for_owner(self.config.reattach_timeout)
                log(
                    f"owner {owner.kind} detached; waiting up to {self.config.reattach_timeout:g} s for the next"
                )
                owner.close("detached")
            elif command == "release":
                if not self.state.ended:
                    return (
                        f"run {self.run_id} is still {self.state.state}: release is for a run that has ended "
                        "(once its output is taken). Send stop to end it."
                    )
                log(f"released by its owner ({owner.kind})")
                self._request("released by its owner")
            self._cond.notify_all()
        return None

    def owner_lost(self, owner: OwnerSession, why: str) -> None:
        with self._cond:
            if owner is not self._owner:
                return  # replaced, detached, or already tearing down
            self._owner = None
            if self._reason is not None:
                return
            if not self.state.ended and not self.config.durable and owner.kind == "task":
                log(f"owner {owner.kind} lost ({why}); the run is not durable")
                self._request(f"its task lost the lifeline ({why}) and the run is not durable")
            else:
                self._wait_for_owner(self.config.reattach_timeout)
                log(
                    f"owner {owner.kind} lost ({why}); waiting up to {self.config.reattach_timeout:g} s for the next"
                )
            self._cond.notify_all()

    # -- teardown

    def request_teardown(self, reason: str) -> None:
        """Tear down soon (from any thread; the thread in :meth:`serve` does it)."""
        with self._cond:
            self._request(reason)
            self._cond.notify_all()

    def _request(self, reason: str, run_error: str | None = None) -> None:
        if self._reason is None:
            self._reason = reason
            self._run_error = run_error

    def teardown(self, reason: str | None = None) -> None:
        """End everything of the run and remove its traces; idempotent."""
        with self._cond:
            if self._tearing_down:
                return
            self._tearing_down = True
            self._request(reason or "torn down")
            reason, run_error = self._reason, self._run_error
            process = self.process
            self._cond.notify_all()
        log(f"tearing down: {reason}")
        if self.server is not None:
            self.server.stop_accepting()  # a new owner now finds nothing: the run is gone
        if not self.state.ended:
            self.state.finish("failed", error=run_error or f"The run was torn down before it ended: {reason}")
        if process is not None:
            self._end_process(process)
        if self._follower is not None:
            self._follower.stop()
        if self.server is not None:
            self.server.close(f"run {self.run_id} was torn down: {reason}")
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.release()
        log("torn down")

    def _end_process(self, process: RunProcess) -> None:
        from airflow_provider_torchdist.processes import end_session

        if self._run_thread.is_alive():  # still running: stop it (and a cluster-side application)
            try:
                process.kill()
            except Exception as exc:  # a failing cluster-side kill must not keep local processes alive
                log(f"spark-submit's kill failed: {exc!r}")
        deadline = time.monotonic() + KILL_WAIT_S
        # spark-submit may only just be starting: end its session until its thread has returned.
        while self._run_thread.is_alive() and time.monotonic() < deadline:
            if process.session is not None:
                end_session(process.session, grace=5.0)
            self._run_thread.join(0.05)
        if process.session is not None:
            left = end_session(process.session, grace=5.0)
            if left:
                log(f"processes of spark-submit's session {process.session} still alive: {left}")
        if self._run_thread.is_alive():
            log(f"spark-submit's thread did not return within {KILL_WAIT_S:g} s")


def _failure_summary(failure: dict[str, Any]) -> str:
    from airflow_provider_torchdist.spark.outcome import RankFailure

    try:
        return RankFailure(**failure).summary()
    except TypeError:
        return str(failure)


# -- the process ----------------------------------------------------------------------------------


def write_start_error(staging_dir: Path, text: str) -> None:
    log(f"cannot start: {text}")
    with contextlib.suppress(OSError):
        write_private_text(staging_dir / ERROR_FILE, text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m airflow_provider_torchdist.supervisor <staging_dir>", file=sys.stderr)
        return EXIT_START_FAILED
    staging = Path(args[0])
    lock: RunLock | None = None
    try:
        config = SupervisorConfig.read(staging)
        plan_text = read_plan_text(staging)
        if config.checkpoint_dir:
            lock = RunLock.acquire(config.checkpoint_dir)
        supervisor = RunSupervisor(staging, config, plan_text=plan_text, lock=lock)
        supervisor.listen()
    except SupervisorStartError as exc:
        if lock is not None:
            lock.release()
        write_start_error(staging, str(exc))
        return exc.exit_code
    except Exception as exc:  # a port that cannot be bound, a host that does not resolve, ...
        if lock is not None:
            lock.release()
        write_start_error(staging, f"{type(exc).__name__}: {exc}")
        return EXIT_START_FAILED
    threading.Thread(target=_sweep, args=(staging,), name="torchdist-sweep", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The handler only hands over to a thread: the main thread may hold the supervisor's lock.
        signal.signal(
            sig,
            lambda signum, _frame: threading.Thread(
                target=supervisor.request_teardown,
                args=(f"the supervisor got {signal.Signals(signum).name}",),
            ).start(),
        )
    return supervisor.serve()


def _sweep(staging: Path) -> None:
    started = time.monotonic()
    try:
        removed = sweep_stale([Path(tempfile.gettempdir()), staging.parent])
    except Exception as exc:  # never worth failing a run for
        log(f"sweeping stale run directories failed: {exc!r}")
        return
    if removed:
        log(
            f"swept {len(removed)} stale run directories in {time.monotonic() - started:.3f} s: {', '.join(map(str, removed))}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
