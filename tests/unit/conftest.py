"""Shared set-up for the unit tests: an isolated Airflow home and no Spark connection.

The environment is set when this module is imported, i.e. before any test module imports Airflow,
so no test reads or writes the user's ~/airflow or picks up a configured ``spark_default``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.object_store import s3_server  # noqa: F401 - the session fixture: moto's S3 server

_AIRFLOW_HOME = tempfile.mkdtemp(prefix="torchdist-unit-airflow-home-")
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)


@pytest.fixture(autouse=True)
def _no_spark_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without a Spark connection; a test that needs one sets it itself."""
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def fast_shutdown(channel):
    """Make a RunChannel poll for shutdown every 10 ms instead of socketserver's 0.5 s (fast tests)."""
    channel._thread = threading.Thread(
        target=channel._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
    )
    return channel


def publish_value(value: object, output_dir: Path, generation: str = "0.0") -> Path:
    """Play rank 0 and the driver for ``value``: encode it as rank 0 does (JSON when JSON-native, else
    cloudpickle), then publish it as the driver does, as ``output.pkl`` with its manifest."""
    import hashlib

    import cloudpickle

    from airflow_provider_torchdist.spark.wire.output_store import (
        FORMAT_JSON,
        FORMAT_PICKLE,
        encode_json,
        is_json_native,
        publish_output,
        type_name,
    )

    fmt = FORMAT_JSON if is_json_native(value) else FORMAT_PICKLE
    data = encode_json(value) if fmt == FORMAT_JSON else cloudpickle.dumps(value)
    part = output_dir / ".torchdist-output-test.pkl"
    part.write_bytes(data)
    return publish_output(
        part,
        output_dir,
        format=fmt,
        type=type_name(value),
        sha256=hashlib.sha256(data).hexdigest(),
        generation=generation,
    )


# -- the hook's run, with spark-submit played in-process ------------------------------------------


class FakeSpark:
    """spark-submit and the training driver, played in this process.

    It replaces ``SparkSubmitHook.submit``, the Spark provider's public method that
    ``Submission.run`` calls: everything before it runs for real (the checks, the staging, the
    :class:`~airflow_provider_torchdist.submit.plan.SubmitPlan`, its properties file, the provider's
    hook built from it). Then it does what the driver would: reads the job spec, calls the payload,
    publishes rank 0's value, writes the outcome; or fails like spark-submit (``raises``).

    What it saw: ``spark_hook`` (the ``SparkSubmitHook`` the plan made), ``application``, ``kwargs``
    (the ``Popen`` arguments), ``dir`` (the run's staging directory), ``spec`` (the job spec),
    ``properties`` (the properties file's content) and ``modes`` (of the directory and the file).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        from airflow_provider_torchdist.spark.wire.outcome import Outcome

        #: What the driver reports; None: it never gets as far as writing an outcome.
        self.outcome: Outcome | None = Outcome(ok=True)
        #: Fail like spark-submit with a non-zero exit code, after the driver's part.
        self.raises = False
        #: Publish rank 0's value, as rank 0 and the driver do on success (a script's: None, as
        #: rank 0 of a script that never calls ``set_output``; ``script_output`` for one that does).
        self.publish = True
        self.script_output: Any = None
        #: Called with the staging directory before the outcome is written: a test's own driver act.
        self.also: Callable[[Path], None] | None = None
        #: Called with the staging directory after it, before spark-submit returns: Spark's stop.
        self.stopping: Callable[[Path], None] | None = None
        self.calls = 0
        self.spark_hook: SparkSubmitHook | None = None
        self.application = ""
        self.kwargs: dict = {}
        self.dir: Path | None = None
        self.spec = None
        self.properties: dict[str, str] = {}
        self.modes: tuple[int, int] | None = None
        fake = self

        def submit(spark_hook: SparkSubmitHook, application: str = "", **kwargs: object) -> None:
            fake.play(spark_hook, application, kwargs)

        monkeypatch.setattr(SparkSubmitHook, "submit", submit)

    def play(self, spark_hook: object, application: str, kwargs: dict) -> None:
        import stat

        import cloudpickle
        from airflow.providers.common.compat.sdk import AirflowException

        from airflow_provider_torchdist.spark.wire.jobspec import SPEC_FILE, JobSpec
        from airflow_provider_torchdist.submit.plan import SPARK_PROPERTIES_FILE
        from airflow_provider_torchdist.submit.properties import read_properties

        self.calls += 1
        self.spark_hook, self.application, self.kwargs = spark_hook, application, dict(kwargs)
        self.dir = staged = Path(application).parent  # the driver script lies in the staging directory
        properties_file = staged / SPARK_PROPERTIES_FILE
        self.properties = read_properties(properties_file)
        self.modes = (stat.S_IMODE(staged.stat().st_mode), stat.S_IMODE(properties_file.stat().st_mode))
        spec = self.spec = JobSpec.read(staged / SPEC_FILE)
        if self.publish and (self.outcome is None or self.outcome.ok):
            if spec.kind == "callable":
                payload = cloudpickle.loads((staged / spec.entry).read_bytes())
                publish_value(payload["fn"](*payload["args"], **payload["kwargs"]), staged)
            else:
                publish_value(self.script_output, staged)
        if self.also is not None:
            self.also(staged)
        if self.outcome is not None:
            self.outcome.write(staged)
        if self.stopping is not None:
            self.stopping(staged)
        if self.raises:
            raise AirflowException("Cannot execute: spark-submit. Error code is: 1.")


@pytest.fixture
def fake_spark(monkeypatch: pytest.MonkeyPatch) -> FakeSpark:
    """spark-submit replaced by :class:`FakeSpark` for every hook the test runs."""
    return FakeSpark(monkeypatch)


@pytest.fixture
def no_submit(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail loudly if any run gets as far as running its plan or starting spark-submit; returns the
    applications that did (none, when the run was refused in time)."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from airflow_provider_torchdist.submit.spark_submit import Submission

    started: list[str] = []

    def run(submission: Submission) -> None:
        started.append(submission.plan.application)
        raise AssertionError("the plan of a run that should have been refused was run")

    def submit(spark_hook: SparkSubmitHook, application: str = "", **kwargs: object) -> None:
        started.append(application)
        raise AssertionError("spark-submit was started for a run that should have been refused")

    monkeypatch.setattr(Submission, "run", run)
    monkeypatch.setattr(SparkSubmitHook, "submit", submit)
    return started


# -- plans without a run ---------------------------------------------------------------------------


def planned_properties(hook, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The Spark settings a run of ``hook`` would write (``submit_plan.spark_properties``); no
    ``spark-defaults.conf`` unless ``environ`` names one."""
    from airflow_provider_torchdist.submit.plan import spark_properties

    return spark_properties(hook.spec, hook.target, None, environ or {})


def plan_without_a_run(
    hook,
    properties_dir: Path,
    *,
    application: str = "/stage/torchdist_driver.py",
    application_args: tuple[str, ...] = ("/stage/spec.json",),
    files: tuple[str, ...] = ("/stage/payload.pkl",),
    py_files: tuple[str, ...] = ("/stage/torchdist_spark.zip",),
    environ: dict[str, str] | None = None,
):
    """A :class:`SubmitPlan` for ``hook``'s spec and target made of the public planning functions,
    with made-up staged files: for targets a test cannot run against (an unreachable cluster)."""
    from airflow_provider_torchdist.submit.plan import build_plan, submit_environment

    props = planned_properties(hook, environ)
    return build_plan(
        hook.spec,
        hook.target,
        application=application,
        application_args=list(application_args),
        files=list(files),
        py_files=list(py_files),
        properties=props,
        properties_dir=properties_dir,
        env=submit_environment(hook.spec, hook.target, props),
    )


class _InlineProcess:
    """What ``start_supervisor`` needs of a started supervisor, for one served in a thread."""

    def __init__(self, thread: threading.Thread) -> None:
        self.pid = os.getpid()
        self._thread = thread

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        return 0


@pytest.fixture
def inline_supervisor(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The run supervisor served in a thread of this process instead of a detached one, so that
    ``FakeSpark`` (which replaces ``SparkSubmitHook.submit`` here) plays its spark-submit. Everything
    else is real: the supervisor's config and plan files, its lifeline, the owner's handshake,
    fetch and release. Returns the supervisors started."""
    from airflow_provider_torchdist.supervision import task_side as run_owner
    from airflow_provider_torchdist.supervision.supervisor import (
        RunSupervisor,
        SupervisorConfig,
        read_plan_text,
    )

    started: list[object] = []

    def launch_supervisor(staging: Path):
        config = SupervisorConfig.read(staging)
        supervisor = RunSupervisor(staging, config, plan_text=read_plan_text(staging))
        supervisor.listen()
        started.append(supervisor)
        thread = threading.Thread(target=supervisor.serve, daemon=True)
        thread.start()
        return _InlineProcess(thread)

    monkeypatch.setattr(run_owner, "launch_supervisor", launch_supervisor)
    return started


# -- the operator's execute, with spark-submit played in-process -------------------------------------


class FakeTI:
    """What the operator uses of a task instance; ``pushed`` holds the last value of each XCom key."""

    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "train", -1, 1
    stats_tags: dict = {}  # noqa: RUF012 (read by ResumableJobMixin)

    def __init__(self):
        self.pushed: dict = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


@pytest.fixture
def faked_spark(monkeypatch, fake_spark, inline_supervisor):
    """spark-submit played in-process (``FakeSpark``) for every run; records each hook the operator
    makes (``make_hook``, its public seam) under ``"hooks"``."""
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
    from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator
    from airflow_provider_torchdist.spark.wire.outcome import Outcome

    fake_spark.outcome = Outcome(ok=True, metrics=[{"rank": 0, "step": 0, "loss": 1.0}])
    hooks: list[TorchDistributorHook] = []
    real = TorchDistributorOperator.make_hook

    def make_hook(self, context=None):
        hooks.append(real(self, context))
        return hooks[-1]

    monkeypatch.setattr(TorchDistributorOperator, "make_hook", make_hook)
    fake_spark.hooks = hooks
    return fake_spark


class MetricRecorder:
    """Stands in for a rank's connection to the driver: keeps the metric records it is sent."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def send(self, message: Any) -> bool:
        self.records.append(message.record)
        return True


@pytest.fixture
def sent_metrics(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Rank 0's ``report()`` records, as its connection to the driver would send them."""
    from airflow_provider_torchdist.spark.node import rank_context

    monkeypatch.setenv("RANK", "0")
    recorder = MetricRecorder()
    rank_context.set_client(recorder)  # type: ignore[arg-type]
    yield recorder.records
    rank_context.set_client(None)
