"""A real Airflow deployment for the tests: ``scripts/airflow-standalone`` and a REST client for it.

``start_deployment`` runs the launcher (API server, scheduler with the LocalExecutor, DAG processor
and triggerer as separate processes; SQLite, unless the settings it is given name another metadata
DB) in a temp AIRFLOW_HOME on a free port, serving a DAG folder of its own; ``stop_deployment``
stops it and says what had to be forced (``running_deployment`` does both, and checks). The
session-scoped ``deployment`` fixture (``tests/integration/conftest.py``) serves the repository's
``dags/`` and ``tests/integration/dags/`` to every test module that asks for it.

The deployment runs with ``TORCHDIST_NO_LOGIN=1`` (SimpleAuthManager's ``all_admins``): the UI
needs no login, and the API token comes from ``GET /auth/token``.

Example::

    run_id = deployment.trigger("lifetime_durable", {"gate_dir": str(gate)})
    deployment.wait_state("lifetime_durable", run_id, "train", {"running"}, timeout=120)
    os.kill(deployment.task_pid("lifetime_durable", run_id, "train"), signal.SIGKILL)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.run_processes import OWN_DIRECTORIES

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "airflow-standalone"
#: The DAG folders the shared deployment serves, each linked into its DAG folder under this name.
DAG_FOLDERS = {"dags": ROOT / "dags", "integration_dags": ROOT / "tests" / "integration" / "dags"}
READY_TIMEOUT = 240
COMPONENT_LOGS = ("launcher.log", "api-server.log", "scheduler.log", "dag-processor.log", "triggerer.log")


class ApiError(Exception):
    """A non-2xx answer from the REST API."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def quote(value: str) -> str:
    """A path segment (run ids hold ``:`` and ``+``)."""
    return urllib.parse.quote(value, safe="")


@dataclass
class Deployment:
    """A running ``scripts/airflow-standalone`` and a REST client for it."""

    url: str
    home: Path
    #: The launcher's pid: its process group, and the parent of the components.
    pgid: int
    token: str = ""
    #: The ``AIRFLOW__SECTION__KEY`` settings it was started with beyond the launcher's own (the
    #: metadata DB's URL, ...): another Airflow process on its home needs them too.
    settings: dict[str, str] = field(default_factory=dict)
    #: Every run :meth:`trigger` started, in order (:meth:`fail_unfinished` ends a test's leftovers).
    triggered: list[tuple[str, str]] = field(default_factory=list)

    # -- REST --------------------------------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
        """One REST call with the bearer token; JSON in, JSON out.

        A GET that gets no answer in 30 s is asked again, up to twice: on a machine loaded far beyond
        its cores the API server once took longer than that (hunt 11), and a read is safe to repeat.
        A call that changes something is not repeated: its timeout fails the test."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token or self.token}"},
        )
        attempts = 3 if method == "GET" else 1
        for attempt in range(1, attempts + 1):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
            except TimeoutError:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    def login(self) -> str:
        """A fresh API token (no login needed: every visitor is admin)."""
        self.token = self.call("GET", "/auth/token")["access_token"]
        return self.token

    def run_path(self, dag_id: str, run_id: str) -> str:
        return f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}"

    def ti_path(self, dag_id: str, run_id: str, task_id: str) -> str:
        return f"{self.run_path(dag_id, run_id)}/taskInstances/{quote(task_id)}"

    def wait_parsed(self, dag_id: str, timeout: float = 120) -> dict[str, Any]:
        """The DAG once the DAG processor has parsed it; fails with the import errors if it does not."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call("GET", f"/api/v2/dags/{quote(dag_id)}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
            if time.monotonic() > deadline:
                errors = self.call("GET", "/api/v2/importErrors")["import_errors"]
                pytest.fail(
                    f"the DAG processor did not parse {dag_id} in {timeout:.0f} s. Import errors:\n"
                    + "\n".join(f"{e['filename']}: {e['stack_trace'][-2000:]}" for e in errors)
                )
            time.sleep(1)

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """Unpause the DAG (once parsed) and start a manual run with ``conf``; its run id."""
        self.wait_parsed(dag_id)
        self.call("PATCH", f"/api/v2/dags/{quote(dag_id)}", {"is_paused": False})
        run = self.call(
            "POST", f"/api/v2/dags/{quote(dag_id)}/dagRuns", {"logical_date": None, "conf": conf or {}}
        )
        self.triggered.append((dag_id, run["dag_run_id"]))
        return run["dag_run_id"]

    def fail_unfinished(self, since: int = 0) -> list[tuple[str, str]]:
        """Mark failed every run triggered since ``triggered[since]`` that has not finished, so that a
        test that failed half-way leaves no run going into the next test (marking the run failed
        fails its running and deferred tasks, which stop their training runs); the runs it ended."""
        ended = []
        for dag_id, run_id in self.triggered[since:]:
            if self.dag_run(dag_id, run_id)["state"] not in ("success", "failed"):
                self.call("PATCH", self.run_path(dag_id, run_id), {"state": "failed"})
                ended.append((dag_id, run_id))
        return ended

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.call("GET", self.run_path(dag_id, run_id))

    def wait_run(
        self, dag_id: str, run_id: str, states: Collection[str] = ("success", "failed"), timeout: float = 300
    ) -> dict[str, Any]:
        """The DAG run once its state is one of ``states``."""

        def reached() -> dict[str, Any] | None:
            run = self.dag_run(dag_id, run_id)
            return run if run["state"] in states else None

        return wait_for(reached, timeout, f"{dag_id} run {run_id} to be {'/'.join(states)}", interval=1)

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        """The task instance as the REST API shows it (``state``, ``try_number``, ``id``, ``pid``...)."""
        return self.call("GET", self.ti_path(dag_id, run_id, task_id))

    def wait_state(
        self, dag_id: str, run_id: str, task_id: str, states: Collection[str], timeout: float = 300
    ) -> dict[str, Any]:
        """The task instance once its state is one of ``states`` (e.g. ``{"running"}``, ``{"deferred"}``)."""
        last: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            nonlocal last
            last = self.task_instance(dag_id, run_id, task_id)
            return last if last["state"] in states else None

        deadline = time.monotonic() + timeout
        while not reached():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{dag_id}.{task_id} in {run_id} did not reach {sorted(states)} in {timeout:.0f} s: it is "
                    f"{last.get('state')!r} (try {last.get('try_number')})\n{self.log_tail(20)}"
                )
            time.sleep(0.5)
        return last

    def wait_trigger(
        self, dag_id: str, run_id: str, task_id: str, timeout: float = 120, not_on: int | None = None
    ) -> dict[str, Any]:
        """The deferred task instance once a live triggerer has taken its trigger (``deferred`` comes
        first: until then nothing runs it). ``not_on``: a triggerer job id to wait until it moves off
        (the one before a restart). The triggerer's job is in ``triggerer_job``."""

        def taken() -> dict[str, Any] | None:
            ti = self.task_instance(dag_id, run_id, task_id)
            job = ti.get("triggerer_job") or {}
            if ti["state"] == "deferred" and job.get("state") == "running" and job.get("id") != not_on:
                return ti
            return None

        ti = wait_for(
            taken, timeout, f"a triggerer to take {dag_id}.{task_id}'s trigger in {run_id}", interval=0.5
        )
        self.wait_deferral_reported(dag_id, run_id, task_id, ti["try_number"])
        return ti

    def wait_deferral_reported(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> None:
        """Wait until the scheduler has taken the executor's report of the deferred try's exit.

        Airflow 3.3's LocalExecutor reports a deferred try's process about 5 s after it exits, under
        the same key as the resumed try. When the trigger fires before the scheduler has taken that
        report, the scheduler can read the stale "success" for the resumed try and fail the task
        ("finished with state success, but the task instance's state attribute is queued"; apache/airflow
        #72716, #71580). A test that lets its run end only after this keeps to the run, not that race."""
        line = (
            "Received executor event with state success for task instance "
            f"TaskInstanceKey(dag_id='{dag_id}', task_id='{task_id}', run_id='{run_id}', try_number={try_number},"
        )
        log = self.home / "scheduler.log"
        wait_for(
            lambda: line in log.read_text(errors="replace"),
            60,
            f"the scheduler to take the executor's report of {dag_id}.{task_id}'s deferral",
            interval=0.2,
        )

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """One try's task log as text, one line per log record (the REST API's structured log), and
        ``ExcType: message`` after a record that carries an exception."""
        path = f"{self.ti_path(dag_id, run_id, task_id)}/logs/{try_number}?full_content=true"
        content = self.call("GET", path)["content"]
        lines = []
        for item in content:
            if not isinstance(item, dict):
                lines.append(str(item))
                continue
            lines.append(item.get("event", ""))
            # A failed try's exception is a structured field of its "Task failed" record.
            for error in item.get("error_detail") or ():
                lines.append(f"{error.get('exc_type')}: {error.get('exc_value')}")
        return "\n".join(lines)

    def log_says(self, dag_id: str, run_id: str, task_id: str, try_number: int, text: str) -> bool:
        """Whether the try's log holds ``text`` yet (False while it has no log to show)."""
        try:
            return text in self.task_log(dag_id, run_id, task_id, try_number)
        except ApiError:
            return False

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"{self.ti_path(dag_id, run_id, task_id)}/xcomEntries/{quote(key)}"
        return self.call("GET", path)["value"]

    def mark_failed(self, dag_id: str, run_id: str, task_id: str) -> None:
        """What the UI's "Mark as failed" does: the running or deferred task is killed."""
        self.call("PATCH", self.ti_path(dag_id, run_id, task_id), {"new_state": "failed"})

    # -- processes ---------------------------------------------------------------------------------

    def task_pid(self, dag_id: str, run_id: str, task_id: str, timeout: float = 60) -> int:
        """The process running the task instance's current try (the one ``execute`` runs in).

        The LocalExecutor's worker (titled ``airflow worker -- LocalExecutor: <ti id>``) supervises
        each try in a child process, which titles itself ``airflow worker -- <ti id>`` (Airflow's
        ``task_runner.startup``); each try has an id of its own. It is the process the REST API
        shows as the task instance's ``pid``, and the parent of the try's spark-submit or supervisor.
        """
        ti_id = self.task_instance(dag_id, run_id, task_id)["id"]
        title = f"airflow worker -- {ti_id}"

        def find() -> int | None:
            for proc in psutil.process_iter():
                try:
                    if " ".join(proc.cmdline()).strip() == title:
                        return proc.pid
                except psutil.Error:
                    continue
            return None

        return wait_for(
            find, timeout, f"the process of {dag_id}.{task_id} in {run_id} ({title})", interval=0.2
        )

    def component(self, name: str) -> psutil.Process:
        """A component the launcher started (``api-server``, ``scheduler``, ``dag-processor``, ``triggerer``)."""
        # `airflow <name> ...` as started, or as the component retitles itself (the API server:
        # `airflow api_server -- host:... port:...`).
        retitled = f"airflow {name.replace('-', '_')} --"
        for proc in psutil.Process(self.pgid).children():
            try:
                args = proc.cmdline()
                if (
                    name in args or " ".join(args).startswith(retitled)
                ) and proc.status() != psutil.STATUS_ZOMBIE:
                    return proc
            except psutil.Error:
                continue
        raise LookupError(f"no live {name} under the launcher {self.pgid}")

    def restart_triggerer(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 120) -> psutil.Process:
        """Stop the triggerer with ``sig`` and have the launcher start it again; returns the new one
        once it heartbeats (:meth:`wait_trigger` with ``not_on`` then says when it has taken over a
        deferred task's trigger).

        ``SIGTERM`` is a clean restart (Airflow cancels the triggers and calls their ``cleanup``);
        ``SIGKILL`` kills the triggerer and its trigger runner process at once (a crash). Either way
        the launcher sees it exit with ``$AIRFLOW_HOME/restart-triggerer`` present and starts it again.
        """
        old = self.component("triggerer")
        tree = [old, *old.children(recursive=True)]
        (self.home / "restart-triggerer").touch()
        asked = time.time()
        for proc in tree if sig == signal.SIGKILL else [old]:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive, f"the triggerer did not stop on {sig.name}: {alive}"

        def heartbeats() -> psutil.Process | None:
            try:
                new = self.component("triggerer")
            except LookupError:
                return None
            health = self.call("GET", "/api/v2/monitor/health").get("triggerer", {})
            beat = health.get("latest_triggerer_heartbeat")
            fresh = beat is not None and datetime.fromisoformat(beat).timestamp() > asked
            return new if new.pid != old.pid and fresh else None

        return wait_for(heartbeats, timeout, f"the triggerer to start again\n{self.log_tail(20)}")

    def run_report(self, dag_id: str, run_id: str, chars: int = 4000) -> str:
        """Every task instance of a DAG run with its state and the end of each try's log, for
        failure messages (a trigger's log is in its task's log)."""
        parts = []
        listing = self.call("GET", f"{self.run_path(dag_id, run_id)}/taskInstances")["task_instances"]
        for ti in listing:
            parts.append(f"=== {ti['task_id']}: {ti['state']} (try {ti['try_number']})")
            for attempt in range(1, (ti["try_number"] or 0) + 1):
                try:
                    log = self.task_log(dag_id, run_id, ti["task_id"], attempt)
                except ApiError as exc:
                    log = str(exc)
                parts.append(f"--- try {attempt}\n{log[-chars:]}")
        return "\n".join(parts)

    def log_tail(self, lines: int = 60) -> str:
        """The end of the launcher's and the components' output, for failure messages."""
        parts = []
        for name in COMPONENT_LOGS:
            path = self.home / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def processes_of(home: Path, pgid: int) -> list[psutil.Process]:
    """Every live process of this deployment: in the launcher's session (the launcher leads both its
    session and process group; task processes take a process group of their own), or started with its
    AIRFLOW_HOME (task processes give spark-submit a session of its own), or naming its home in its
    command line (a run supervisor, forked from a task process: its title names its staging
    directory). Airflow's retitled processes (``airflow worker -- ...``) show an empty environment,
    hence the session."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            ours = pgid in (os.getpgid(proc.pid), os.getsid(proc.pid))
            if ours or f"{home}{os.sep}" in " ".join(proc.cmdline()):
                found.append(proc)
            elif proc.environ().get("AIRFLOW_HOME") == str(home):
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def _made(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def dag_folder(path: Path, sources: dict[str, Path] = DAG_FOLDERS) -> Path:
    """A DAG folder linking each of ``sources`` in as a subfolder (the DAG processor follows links)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        (path / name).symlink_to(source, target_is_directory=True)
    return path


def start_deployment(
    home: Path, dags: Path, settings: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Deployment]:
    """Start ``scripts/airflow-standalone`` in ``home`` serving ``dags``, on a free port; returns once
    it reports ready (failing the test with the components' logs if it does not). ``settings``:
    more ``AIRFLOW__SECTION__KEY`` variables for it (e.g. the metadata DB's URL)."""
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AIRFLOW__", "AIRFLOW_CONN_")) and key != "VIRTUAL_ENV"
    }
    env |= {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_PORT": str(port),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        # The tasks' Connect session ids (spark.connect.sessions.session_cache): the deployment's own.
        "XDG_CACHE_HOME": str(home / "cache"),
        "TORCHDIST_NO_LOGIN": "1",
        # Its tasks stage their runs under its home: their supervisors (forked from retitled task
        # processes, so with no readable environment) name it in their process titles.
        "TMPDIR": str(_made(home / "tmp")),
        "READY_TIMEOUT": str(READY_TIMEOUT),
        # A PATH without the venv: the launcher must put it there itself (components run as `airflow`).
        "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p),
    }
    env |= settings or {}
    OWN_DIRECTORIES.append(str(home))
    started = time.monotonic()
    with open(home / "launcher.log", "wb") as out:
        launcher = subprocess.Popen(
            ["bash", str(LAUNCHER)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deployment = Deployment(
        url=f"http://127.0.0.1:{port}", home=home, pgid=launcher.pid, settings=dict(settings or {})
    )

    def ready() -> bool:
        assert launcher.poll() is None, (
            f"the launcher exited ({launcher.returncode}):\n{deployment.log_tail()}"
        )
        return "Airflow is ready at" in (home / "launcher.log").read_text(errors="replace")

    try:
        wait_for(ready, READY_TIMEOUT + 30, "scripts/airflow-standalone to report ready")
    except BaseException:
        stop_deployment(launcher, home)
        raise
    print(f"deployment ready in {time.monotonic() - started:.1f} s")
    return launcher, deployment


def stop_deployment(launcher: subprocess.Popen[bytes], home: Path) -> list[str]:
    """SIGTERM the launcher (it stops the components cleanly), then force whatever is left; return
    what had to be forced."""
    pgid = launcher.pid
    launcher.send_signal(signal.SIGTERM)
    try:
        # Longer than the launcher's own 60 s grace for its components (a scheduler waits for its
        # LocalExecutor's running tasks), so that its own stop, kill included, ends first.
        launcher.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pass
    forced = []
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        left = processes_of(home, pgid)
        if not left:
            break
        forced += [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if sig == signal.SIGTERM]
        for proc in left:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=grace)
    launcher.wait(timeout=10)
    return forced


@contextlib.contextmanager
def running_deployment(
    home: Path, dags: Path, settings: Mapping[str, str] | None = None
) -> Iterator[Deployment]:
    """:func:`start_deployment`, logged in; on leaving, :func:`stop_deployment`, failing if any of
    its processes is left or had to be forced (the launcher stops its components by itself)."""
    launcher, running = start_deployment(home, dags, settings)
    try:
        running.login()
        yield running
    finally:
        forced = stop_deployment(launcher, home)
        left = processes_of(home, launcher.pid)
        assert not left, f"processes left running: {[' '.join(p.cmdline())[:120] for p in left]}"
        assert not forced, f"processes outlived the launcher's clean stop: {forced}"
