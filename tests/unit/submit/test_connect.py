"""Spark Connect as the engine, without a server: the connection, the checks, the submission, the
channel's node verifier. The runs themselves are in ``tests/integration/test_connect.py``."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed
from airflow_provider_torchdist.spark.connect.driver import channel_host, job_tag, main, redact_url
from airflow_provider_torchdist.spark.connect.job import ConnectVerifier, SlotWatch, local_slots
from airflow_provider_torchdist.spark.connect.sessions import (
    planned_session_id,
    run_session_url,
    with_session,
)
from airflow_provider_torchdist.spark.wire.channel_auth import HelloRefused
from airflow_provider_torchdist.submit.connect import ConnectSubmission, check_connect_run, submission_for
from airflow_provider_torchdist.submit.spark_submit import Submission


@pytest.fixture
def listening() -> int:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def _connect_hook(monkeypatch: pytest.MonkeyPatch, port: int, **settings) -> TorchDistributorHook:
    conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": port, "password": "s3cret-token"}
    monkeypatch.setenv("AIRFLOW_CONN_SC", json.dumps(conn))
    return TorchDistributorHook(conn_id="sc", num_processes=2, **settings)


def test_a_spark_connect_connection_is_a_connect_target_whose_url_keeps_the_token_out_of_the_master(
    monkeypatch, listening
) -> None:
    hook = _connect_hook(monkeypatch, listening)
    assert hook.target.is_connect
    assert hook.target.master == f"sc://127.0.0.1:{listening}"  # what logs and errors show
    assert "token=s3cret-token" in hook.target.connect_url  # as SparkConnectHook builds it
    assert hook.target.connection["conn_type"] == "spark_connect"


def test_the_plan_of_a_connect_target_runs_the_connect_driver_not_spark_submit(
    monkeypatch, listening
) -> None:
    hook = _connect_hook(monkeypatch, listening)
    plain = TorchDistributorHook(num_processes=2)
    assert isinstance(submission_for(_plan(hook)), ConnectSubmission)
    assert type(submission_for(_plan(plain))) is Submission


def _plan(hook: TorchDistributorHook):
    from airflow_provider_torchdist.submit.prepare import check_and_stage, plan_staged

    staged, props, env = check_and_stage(hook.spec, hook.target, hook.log, lambda: 1, [], {})
    try:
        return plan_staged(hook.spec, hook.target, staged, props, env)
    finally:
        staged.cleanup()


def test_local_mode_is_refused_over_connect_before_anything_starts(monkeypatch, listening):
    hook = _connect_hook(monkeypatch, listening, local_mode=True)
    with pytest.raises(
        InvalidTrainingConfig, match="local_mode=True cannot run over the Spark Connect connection 'sc'"
    ):
        check_connect_run(hook.spec, hook.target)


def test_an_elastic_range_is_taken_over_connect(monkeypatch, listening) -> None:
    _connect_hook(monkeypatch, listening)  # the connection
    hook = TorchDistributorHook(conn_id="sc", num_processes="1:2")
    check_connect_run(hook.spec, hook.target)  # the Connect client serves the rendezvous: no refusal


def test_an_elastic_run_over_a_connect_channel_without_tls_is_refused_before_anything_starts(
    monkeypatch, tmp_path
) -> None:
    """Issue 40: over Connect an elastic run's nodes' claim secrets travel in the job's plan. Over a
    plain channel to a server off this machine it is refused, before anything is staged or sent
    (the host is TEST-NET: nothing is ever reached), saying what to set."""
    from airflow_provider_torchdist.submit.connect import check_connect_transport

    def connection(conn_id: str, **extra) -> TorchDistributorHook:
        conn = {"conn_type": "spark_connect", "host": "192.0.2.10", "port": 15002, "extra": extra}
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
        return TorchDistributorHook(conn_id=conn_id, num_processes="1:2", staging_dir=str(tmp_path))

    hook = connection("plain")
    with pytest.raises(InvalidTrainingConfig) as info:
        hook.run(lambda: 1)
    message = str(info.value)
    assert "num_processes='1:2' over the Spark Connect connection 'plain'" in message
    assert "use_ssl: true" in message and '"trusted-network": true' in message
    assert list(tmp_path.iterdir()) == []  # nothing staged, nothing submitted
    # TLS, or the connection's word that its network is trusted, or a fixed size: taken.
    check_connect_transport(connection("tls", use_ssl=True).spec, connection("tls", use_ssl=True).target)
    trusted = connection("trusted", **{"trusted-network": "true"})
    check_connect_transport(trusted.spec, trusted.target)
    fixed = TorchDistributorHook(conn_id="plain", num_processes=2)
    check_connect_transport(fixed.spec, fixed.target)
    # A loopback server: the plan crosses no network.
    monkeypatch.setenv("AIRFLOW_CONN_LOOP", json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1"}))
    loop = TorchDistributorHook(conn_id="loop", num_processes="1:2")
    check_connect_transport(loop.spec, loop.target)


def test_train_data_is_taken_over_connect(monkeypatch, listening) -> None:
    hook = _connect_hook(monkeypatch, listening, train_data="SELECT 1 AS x")
    check_connect_run(hook.spec, hook.target)  # the server's session runs the query: no refusal


def test_an_unreachable_server_is_said_with_its_address_and_no_token(monkeypatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    hook = _connect_hook(monkeypatch, port)
    with pytest.raises(SparkSubmitFailed) as info:
        check_connect_run(hook.spec, hook.target, timeout=1)
    assert f"Cannot reach the Spark Connect server sc://127.0.0.1:{port}" in str(info.value)
    assert "s3cret" not in str(info.value)


def test_the_url_reaches_the_driver_in_its_environment_never_on_its_command_line(monkeypatch, listening):
    hook = _connect_hook(monkeypatch, listening)
    plan = _plan(hook)
    assert not any("s3cret" in arg for arg in plan.application_args)
    assert "token=s3cret-token" in plan.connection["url"]


def test_the_verifier_takes_each_node_once_on_the_host_it_connects_from() -> None:
    conflicts: list[str] = []
    verify = ConnectVerifier(2, on_conflict=conflicts.append)
    assert verify(0, 11, "10.0.0.5") == "10.0.0.5"
    assert verify(1, 12, "10.0.0.6") == "10.0.0.6"
    with pytest.raises(
        HelloRefused, match="node 0 registered a second time .*from 10.0.0.7; first from 10.0.0.5"
    ):
        verify(0, 13, "10.0.0.7")
    assert len(conflicts) == 1 and "someone else holds the run's token" in conflicts[0]  # the run stops
    with pytest.raises(HelloRefused, match="node 2 is not one of this run's 2 node"):
        verify(2, 14, "10.0.0.8")
    assert len(conflicts) == 1


def test_an_elastic_runs_verifier_takes_a_node_again_only_once_its_agent_is_gone_and_not_forever() -> None:
    said: list[str] = []
    verify = ConnectVerifier(2, on_conflict=said.append, retries=1)
    assert verify(1, 12, "10.0.0.6") == "10.0.0.6"
    # A claim while the node's agent is still in the run: refused, the run goes on.
    with pytest.raises(HelloRefused, match="node 1 claimed again .* still in the run"):
        verify(1, 13, "10.0.0.9")
    verify.release(1)  # its agent died
    assert verify(1, 15, "10.0.0.5") == "10.0.0.5"  # its lost task's retry, on another host
    assert verify(0, 18, "10.0.0.7") == "10.0.0.7"  # a first claim is no comeback
    verify.release(0)  # the budget is the run's: another node's comeback is past it too
    with pytest.raises(HelloRefused, match="past the run's 1 comeback\\(s\\) in all \\(1 taken\\)"):
        verify(0, 16, "10.0.0.5")
    with pytest.raises(HelloRefused, match="node 2 is not one of this run's 2 node"):
        verify(2, 17, "10.0.0.8")
    assert len(said) == 2


def test_an_elastic_range_over_connect_needs_torch_on_the_worker(monkeypatch, listening) -> None:
    import importlib.util

    _connect_hook(monkeypatch, listening)
    hook = TorchDistributorHook(conn_id="sc", num_processes="1:2")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(InvalidTrainingConfig, match="serves its rendezvous store from this worker"):
        check_connect_run(hook.spec, hook.target)


def test_the_token_is_taken_out_of_an_error_that_quotes_the_url() -> None:
    url = "sc://h:15002/;token=ab%2Bc/d;use_ssl=true"
    error = "INVALID_CONNECT_URL: The path component '/;token=ab%2Bc/d' ... token=ab+c/d"
    redacted = redact_url(error, url)
    assert "ab%2Bc/d" not in redacted and "ab+c/d" not in redacted and redacted.count("***") == 2
    assert redact_url("nothing to hide", url) == "nothing to hide"


@pytest.mark.parametrize(
    "settings, train_object, message",
    [
        (
            {"conf": {"spark.executor.memory": "2g"}},
            None,
            "conf cannot apply over the Spark Connect connection",
        ),
        ({"spark_submit_kwargs": {"executor_cores": 2}}, None, "spark_submit_kwargs cannot apply"),
    ],
    ids=["conf", "spark_submit_kwargs"],
)
def test_settings_the_server_owns_are_refused(monkeypatch, listening, settings, train_object, message):
    hook = _connect_hook(monkeypatch, listening, **settings)
    with pytest.raises(InvalidTrainingConfig, match=message):
        check_connect_run(hook.spec, hook.target, train_object)


def test_a_token_with_a_slash_is_refused_without_showing_it(monkeypatch) -> None:
    conn = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": 15002, "password": "se/cret"}
    monkeypatch.setenv("AIRFLOW_CONN_SC", json.dumps(conn))
    hook = TorchDistributorHook(conn_id="sc", num_processes=2)
    with pytest.raises(InvalidTrainingConfig, match="does not make a valid sc://host:port URL") as info:
        check_connect_run(hook.spec, hook.target)
    assert "se/cret" not in str(info.value) and "cret" not in str(info.value)


def test_the_channel_binds_on_the_route_to_the_server_and_the_job_has_the_runs_tag() -> None:
    assert channel_host("sc://127.0.0.1:15002/;token=x") == "127.0.0.1"
    assert channel_host("sc://127.0.0.1:15002", server_driver_host="127.0.0.1") == "127.0.0.1"
    assert channel_host("sc://127.0.0.1:15002", "127.0.0.1", configured="10.9.8.7") == "10.9.8.7"
    assert job_tag("run-1") == "torchdist-run-1"


def test_a_driver_without_a_url_writes_a_failed_outcome(tmp_path) -> None:
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec
    from airflow_provider_torchdist.spark.wire.outcome import Outcome

    spec = JobSpec(kind="callable", entry="payload.pkl", num_processes=2, run_id="r", token="t" * 32)
    path = spec.write(tmp_path)
    assert main(["connect_driver", str(path)], environ={}) == 1
    outcome = Outcome.read(tmp_path)
    assert outcome is not None and not outcome.ok
    assert "TORCHDIST_CONNECT_URL is not set" in outcome.error


@pytest.mark.parametrize(
    "master, cpus, slots",
    [
        ("local[2]", 1, 2),
        ("local[4]", 2, 2),
        ("local", 1, 1),
        ("local[3,2]", 1, 3),
        ("local[*]", 1, None),
        ("spark://h:7077", 1, None),
    ],
)
def test_a_local_server_master_says_its_slots(master, cpus, slots) -> None:
    assert local_slots(master, cpus) == slots


class _Channel:
    address = ("127.0.0.1", 4242)

    def __init__(self) -> None:
        self.started_nodes: set[int] = set()
        self.said: list[str] = []

    def say(self, text: str) -> None:
        self.said.append(text)


def _wait_for(cancelled: list[bool], timeout: float = 10.0) -> None:
    """Until the watch has cancelled the stage, or ``timeout`` seconds (the caller asserts which)."""
    deadline = time.monotonic() + timeout
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_slot_watch_cancels_a_stage_whose_tasks_did_not_all_start_in_time() -> None:
    channel, cancelled = _Channel(), []
    channel.started_nodes.add(0)
    watch = SlotWatch(channel, 2, 1.0, lambda: cancelled.append(True))
    with watch:
        _wait_for(cancelled)
    assert cancelled == [True]
    assert "needs 2 task slot(s) at once, and 1 of its tasks started within slot_timeout=1s" in watch.error


def test_an_elastic_runs_slot_watch_is_content_with_min_nodes_and_says_so_when_it_gives_up() -> None:
    channel, cancelled = _Channel(), []
    channel.started_nodes.add(2)
    with SlotWatch(channel, 1, 1.0, lambda: cancelled.append(True), elastic=True):
        time.sleep(2.5)  # MIN=1 started: no verdict, however long the others wait
    assert cancelled == []
    channel.started_nodes.clear()
    watch = SlotWatch(channel, 2, 1.0, lambda: cancelled.append(True), elastic=True)
    with watch:
        _wait_for(cancelled)
    assert "The elastic run needs 2 task slot(s) (its MIN), and 0 of its tasks started" in watch.error


def test_with_train_data_the_slot_watch_starts_its_clock_once_the_shuffle_stages_are_done() -> None:
    from types import SimpleNamespace as Stage

    channel, cancelled = _Channel(), []
    watch = SlotWatch(channel, 2, 1.0, lambda: cancelled.append(True), after_shuffle=True)
    with watch:
        time.sleep(2.5)  # past slot_timeout, but the rows are still being dealt: no verdict
        watch.progress(stages=[Stage(stage_id=0, done=False, num_tasks=4)], inflight_tasks=4)
        watch.progress(stages=[Stage(stage_id=0, done=False), Stage(stage_id=1, done=False)])
        time.sleep(1.5)
        assert cancelled == []
        # The shuffle's stage is done and the barrier stage waits for its slots: the clock runs.
        watch.progress(stages=[Stage(stage_id=0, done=True), Stage(stage_id=1, done=False)])
        _wait_for(cancelled)
    assert cancelled == [True]
    assert "needs 2 task slot(s) at once" in watch.error


def test_the_slot_watch_clock_starts_when_adaptive_execution_ran_the_shuffle_as_a_job_of_its_own() -> None:
    """The shuffle's job reports its stage done; the barrier job then lists that stage again, skipped,
    and no report ever shows it done there: it counts as done all the same."""
    from types import SimpleNamespace as Stage

    channel, cancelled = _Channel(), []
    watch = SlotWatch(channel, 2, 1.0, lambda: cancelled.append(True), after_shuffle=True)
    with watch:
        watch.progress(stages=[Stage(stage_id=3, done=True)])  # the shuffle's own job
        watch.progress(stages=[Stage(stage_id=3, done=False), Stage(stage_id=4, done=False)])
        _wait_for(cancelled)
    assert cancelled == [True]
    assert "needs 2 task slot(s) at once" in watch.error


def test_the_slot_watch_leaves_a_stage_alone_once_every_task_started() -> None:
    channel, cancelled = _Channel(), []
    channel.started_nodes.update({0, 1})
    with SlotWatch(channel, 2, 1.0, lambda: cancelled.append(True)) as watch:
        time.sleep(2.5)
    assert cancelled == [] and watch.error is None


def test_every_run_over_one_connection_gets_a_session_of_its_own() -> None:
    """Issue 40: runs of different DAGs over one connection shared one Connect session (temp views,
    settings, Python workers). Each run's plan now names a fresh one; a URL that names a session
    itself is the user's choice, kept."""
    url = "sc://h:15002/;token=abc"
    first, second = planned_session_id(run_session_url(url)), planned_session_id(run_session_url(url))
    assert first and second and first != second
    assert str(uuid.UUID(first)) == first
    named = f"{url};session_id={SESSION}"
    assert run_session_url(named) == named


def test_a_session_id_rides_in_the_urls_parameters() -> None:
    sid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert with_session("sc://h:1", sid) == f"sc://h:1/;session_id={sid}"
    assert with_session("sc://h:1/;token=t", sid) == f"sc://h:1/;token=t;session_id={sid}"
    # A session the URL named already is replaced, not named twice.
    assert (
        with_session(f"sc://h:1/;session_id={SESSION};token=t", sid) == f"sc://h:1/;token=t;session_id={sid}"
    )


def test_the_plan_of_each_connect_run_names_its_own_session(monkeypatch, listening) -> None:
    hook = _connect_hook(monkeypatch, listening)
    urls = [_plan(hook).connection["url"] for _ in range(2)]
    sessions = {planned_session_id(url) for url in urls}
    assert len(sessions) == 2 and None not in sessions
    assert all("token=s3cret-token" in url for url in urls)


def test_spark_submit_never_inherits_a_connect_clients_environment(fake_spark, monkeypatch, tmp_path) -> None:
    """``SparkSession.builder.remote`` marks its process a Connect client; a spark-submit driver
    inheriting that refuses to make a SparkContext."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    monkeypatch.setenv("SPARK_REMOTE", "sc://elsewhere:15002")
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path))
    assert hook.run(lambda: 7) == 7
    env = fake_spark.kwargs["env"]
    assert not {"SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE"} & env.keys()
    assert env["PATH"]  # the rest of the environment is there


SESSION, OPERATION = "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10", "5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"


def test_a_lost_runs_job_is_interrupted_in_its_recorded_session(monkeypatch, listening) -> None:
    from airflow_provider_torchdist.hooks import supervised as hook_module
    from airflow_provider_torchdist.supervision.record import RunRecord

    calls: list[tuple[str, str, str]] = []
    monkeypatch.setattr(hook_module, "interrupt_lost_run", lambda *args: calls.append(args) or [OPERATION])
    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    hook = _connect_hook(monkeypatch, listening)
    assert hook.end_lost_run(record) == []  # no session recorded: nothing to go by
    assert calls == []
    # The session is recorded from the start: a job still waiting for its slots (no operation yet) too.
    assert hook.end_lost_run(record.with_session(SESSION)) == [OPERATION]
    assert calls == [(hook.target.connect_url, SESSION, "run-1")]  # by the run's tag, in its session
    assert TorchDistributorHook(num_processes=2).end_lost_run(record.with_session(SESSION)) == []
    assert len(calls) == 1  # a spark-submit run leaves no Connect job


class FakeConnect:
    """``SparkSession.builder.remote`` for :func:`interrupt_lost_run`: records what it was asked."""

    def __init__(self, interrupt=lambda tag: ["op-1"]) -> None:
        self.urls: list[str] = []
        self.tags: list[str] = []
        self.closed = self.stopped = 0
        self._interrupt = interrupt

    def __call__(self, url: str):
        import os

        self.urls.append(url)
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # as SparkSession.builder.remote does
        return self

    def create(self):
        return self

    def interruptTag(self, tag: str):  # noqa: N802 (pyspark's name)
        self.tags.append(tag)
        return self._interrupt(tag)

    @property
    def client(self):
        return self

    def close(self) -> None:
        self.closed += 1

    def release_session(self) -> None:
        self.stopped += 1


def test_interrupting_a_lost_run_uses_its_tag_in_its_session_and_releases_it(monkeypatch) -> None:
    import os

    from airflow_provider_torchdist.submit.connect import interrupt_lost_run

    monkeypatch.delenv("SPARK_CONNECT_MODE_ENABLED", raising=False)
    fake = FakeConnect()
    assert interrupt_lost_run("sc://h:15002/;token=t", SESSION, "run-1", remote=fake) == ["op-1"]
    assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ  # the task's process is not left marked
    assert fake.urls == [f"sc://h:15002/;token=t;session_id={SESSION}"]
    assert fake.tags == ["torchdist-run-1"]
    assert (fake.closed, fake.stopped) == (1, 1)  # the run's own session: released
    # A session the connection's URL names is the user's: interrupted there, not released.
    kept = FakeConnect()
    interrupt_lost_run(f"sc://h:1/;session_id={SESSION}", SESSION, "run-1", remote=kept)
    assert (kept.closed, kept.stopped) == (1, 0)


def test_a_closed_session_has_nothing_to_interrupt_and_other_errors_are_raised() -> None:
    from airflow_provider_torchdist.submit.connect import interrupt_lost_run

    def closed(tag):
        raise RuntimeError("[INVALID_HANDLE.SESSION_CLOSED] the session was closed")

    assert interrupt_lost_run("sc://h:1", SESSION, "run-1", remote=FakeConnect(closed)) == []

    def refused(tag):
        raise RuntimeError("PERMISSION_DENIED")

    with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
        interrupt_lost_run("sc://h:1", SESSION, "run-1", remote=FakeConnect(refused))


def test_a_server_that_does_not_answer_fails_the_interrupt_in_bounded_time() -> None:
    import threading

    from airflow_provider_torchdist.submit.connect import interrupt_lost_run

    never = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="did not answer within 0 s"):
            interrupt_lost_run(
                "sc://h:1", SESSION, "run-1", timeout=0.2, remote=FakeConnect(lambda t: never.wait())
            )
    finally:
        never.set()


def test_the_planned_session_is_the_one_the_runs_url_names() -> None:
    url = "sc://h:15002/;token=t"
    assert planned_session_id(url) is None  # the hook's plan always names one (run_session_url)
    assert planned_session_id(f"{url};session_id={SESSION}") == SESSION
    assert planned_session_id(f"{url};session_id=mine") is None  # not a UUID: nothing to record


def test_the_operation_is_announced_once_with_the_application(tmp_path) -> None:
    from airflow_provider_torchdist.spark.connect.job import OperationAnnouncer

    said: list[tuple] = []
    channel = type("Channel", (), {"application": lambda self, *args: said.append(args)})()
    announce = OperationAnnouncer(channel, "app-1", SESSION)
    announce.progress(stages=[], inflight_tasks=0, operation_id=None, done=False)  # not named yet
    announce.progress(stages=[], inflight_tasks=2, operation_id=OPERATION, done=False)
    announce.progress(stages=[], inflight_tasks=2, operation_id=OPERATION, done=False)
    announce.last_call()
    assert said == [("app-1", None, f"{SESSION}/{OPERATION}")]
    quiet = OperationAnnouncer(channel, "app-2", SESSION)
    quiet.last_call()  # the job ended before any progress report: the application alone
    assert said[1:] == [("app-2", None, None)]
    hidden = OperationAnnouncer(channel, None, SESSION)  # a server that hides spark.app.id
    hidden.progress(stages=[], inflight_tasks=2, operation_id=OPERATION, done=False)
    assert said[2:] == []  # no application to name (the record has the session from the start)


def test_a_payload_over_the_servers_message_limit_is_refused_before_the_job_goes() -> None:
    from airflow_provider_torchdist.spark.connect.job import check_payload_size

    conf = type("Conf", (), {"get": lambda self, key, default=None: str(8 * 2**20)})()
    spark = type("Spark", (), {"conf": conf})()
    check_payload_size(6 * 2**20, spark)
    with pytest.raises(
        ValueError, match=r"is 8\.0 MiB.*up to 8 MiB \(spark\.connect\.grpc\.maxInboundMessageSize\)"
    ):
        check_payload_size(8 * 2**20, spark)


def test_the_users_py_files_go_to_the_connect_driver_but_not_the_providers_own_zip(
    monkeypatch, listening, tmp_path
) -> None:
    from airflow_provider_torchdist.submit import connect as connect_engine
    from airflow_provider_torchdist.submit.staging import SPARK_ZIP

    helper = tmp_path / "helper.py"
    helper.write_text("X = 1\n")
    plan = _plan(_connect_hook(monkeypatch, listening, py_files=[str(helper)]))
    assert any(p.endswith(SPARK_ZIP) for p in plan.py_files)  # what spark-submit would ship
    commands: list[list[str]] = []

    class Exited:
        def __init__(self, command, **kwargs):
            commands.append(command)
            self.pid, self.stdout = 0, iter(())

        def wait(self):
            return 0

    monkeypatch.setattr(connect_engine.subprocess, "Popen", Exited)
    ConnectSubmission(plan).run()
    (command,) = commands
    assert command[-2:] == [*plan.application_args, str(helper)]
    assert not any(SPARK_ZIP in arg or "s3cret" in arg for arg in command)


def test_an_elastic_runs_node_watch_counts_a_lost_node_once_and_nothing_after_the_run_stopped() -> None:
    """A node's latest registration that goes counts (the survivors restart, the history notes it,
    Spark's retry may claim it again); an earlier registration's late close, or anything once the
    run has stopped (the nodes Spark then stops), does not."""
    from airflow_provider_torchdist.spark.connect.elastic import NodeWatch
    from airflow_provider_torchdist.spark.wire.channel_auth import NodeRegistry
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

    class Store:
        restarts: list[float] = []

        def restart_survivors(self, lost_at: float) -> int:
            self.restarts.append(lost_at)
            return len(self.restarts)

    spec = JobSpec(kind="callable", entry="payload.pkl", num_processes="1:2", run_id="r", token="t")
    cancelled: list[bool] = []
    store = Store()
    watch = NodeWatch(spec, store, lambda: cancelled.append(True), say=lambda _: None)
    watch.registry = NodeRegistry(lambda _: range(2), watch.verifier)
    first = watch.registry.register(1, 11, "10.0.0.6")
    watch.node_gone(first)
    watch.node_gone(first)  # its NodeLeft, then its connection closing: one loss
    assert len(store.restarts) == 1 and [h for _, h in watch.monitor.history.losses] == ["10.0.0.6"]
    second = watch.registry.register(1, 12, "10.0.0.5")  # Spark's retry: released, so taken
    watch.node_gone(first)  # the first registration again: not the node's latest
    assert len(store.restarts) == 1
    watch.stop()
    watch.node_gone(second)  # stopped by the run's own stop: no loss
    assert len(store.restarts) == 1 and cancelled == [True]
