"""TorchDistributorOperator: parse-time checks, templating, post-render coercion, execute and XCom."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import (
    METRICS_XCOM_KEY,
    WORLD_SIZES_XCOM_KEY,
    TorchDistributorOperator,
)
from airflow_provider_torchdist.operators.xcom import CHECKPOINT_DIR_XCOM_KEY
from airflow_provider_torchdist.outputs.results import (
    ENVELOPE_KEY,
    ENVELOPE_VERSION,
    OutputSignatureError,
    load_output,
    output_origin,
)
from airflow_provider_torchdist.spark.wire.outcome import Outcome, RankFailure
from tests.unit.conftest import FakeTI, plan_without_a_run


def _train(x=1, scale=1):
    return x * scale


def _op(**kwargs) -> TorchDistributorOperator:
    return TorchDistributorOperator(**{"task_id": "train", "train_object": _train, **kwargs})


# -- parse time ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": "abc"}, "num_processes"),
        ({"train_object": 42}, "train_object"),
        ({"train_object": None}, "train_object"),
        ({"num_processes": 4, "nproc_per_node": 3}, "nproc_per_node=3"),
        ({"use_gpu": "yes"}, "use_gpu"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"args": 5}, "args must be a list"),
        ({"kwargs": [1]}, "kwargs must be a dict"),
    ],
)
def test_bad_values_fail_at_construction(kwargs, field):
    with pytest.raises(InvalidTrainingConfig, match=field):
        _op(**kwargs)


def test_unknown_keyword_fails_at_construction():
    # A TypeError still, as BaseOperator's own was; now naming the closest argument.
    with pytest.raises(TypeError, match=r"unknown argument: num_procs \(did you mean num_processes\?\)"):
        _op(num_procs=2)


def test_templates_are_accepted_at_parse_time():
    op = _op(
        train_object="{{ params.script }}",
        num_processes="{{ params.n }}",
        nproc_per_node=3,  # cannot be checked against a template yet
        local_mode="{{ params.local }}",
        use_gpu="{{ params.gpu }}",
        max_restarts="{{ params.restarts }}",
        args="{{ params.args }}",
        kwargs="{{ params.kwargs }}",
    )
    assert op.num_processes == "{{ params.n }}"
    assert op.nproc_per_node == 3


def test_parse_time_values_are_coerced():
    op = _op(num_processes="4", nproc_per_node="2", local_mode="false", use_gpu="False", max_restarts="1")
    assert (op.num_processes, op.nproc_per_node, op.local_mode, op.use_gpu, op.max_restarts) == (
        4,
        2,
        False,
        False,
        1,
    )


def test_kwargs_are_stored_as_train_kwargs_and_not_a_template_field():
    op = _op(args=[1], kwargs={"scale": 3})
    assert op.train_kwargs == {"scale": 3}
    assert op.train_args == [1]
    assert "kwargs" not in op.template_fields
    assert "args" not in op.template_fields
    assert {"train_kwargs", "train_args", "train_script", "num_processes", "conf"} <= set(op.template_fields)
    assert "train_object" not in op.template_fields  # a callable template field is called by Airflow


# -- after rendering ----------------------------------------------------------------------------


def test_rendered_strings_are_coerced():
    op = _op(num_processes="{{ params.n }}", local_mode="{{ params.local }}", use_gpu="{{ params.gpu }}")
    op.num_processes, op.local_mode, op.use_gpu, op.max_restarts = "2", "True", "false", "3"
    spec = op.training_spec()
    assert (spec.num_processes, spec.local_mode, spec.use_gpu, spec.max_restarts) == (2, True, False, 3)


def test_rendered_garbage_is_refused_by_name():
    op = _op(num_processes="{{ params.n }}")
    op.num_processes = "abc"
    with pytest.raises(InvalidTrainingConfig, match="num_processes must be an integer"):
        op.training_spec()


def test_rendered_topology_is_checked():
    op = _op(num_processes="{{ params.n }}", nproc_per_node=2)
    op.num_processes = "3"
    with pytest.raises(InvalidTrainingConfig, match="num_processes=3 is not divisible by nproc_per_node=2"):
        op.training_spec()


def test_a_still_unrendered_template_is_refused_after_rendering():
    op = _op(num_processes="{{ params.n }}")
    with pytest.raises(InvalidTrainingConfig, match="num_processes"):
        op.training_spec()


def test_rendered_args_string_is_refused(no_submit):
    op = _op(args="{{ params.args }}")
    op.train_args = "[1, 2]"
    with pytest.raises(InvalidTrainingConfig, match="args must be a list, got str"):
        op.execute({"ti": FakeTI()})
    assert no_submit == []


def test_rendered_kwargs_string_is_refused_as_not_a_dict(no_submit):
    op = _op(kwargs="{{ params.kwargs }}")
    op.train_kwargs = "{'scale': 2}"
    with pytest.raises(InvalidTrainingConfig, match="kwargs must be a dict, got str"):
        op.execute({"ti": FakeTI()})
    assert no_submit == []


def test_render_template_fields_renders_fields_but_never_calls_the_callable():
    calls = []

    def train(*args, **kwargs):
        calls.append((args, kwargs))
        return 0

    op = TorchDistributorOperator(
        task_id="t",
        train_object=train,
        num_processes="{{ params.n }}",
        local_mode="{{ params.local }}",
        kwargs={"lr": "{{ params.lr }}"},
        conf={"spark.executor.memory": "{{ params.mem }}"},
    )
    op.render_template_fields({"params": {"n": 2, "local": True, "lr": 0.1, "mem": "2g"}})
    assert calls == []
    assert op.train_object is train
    assert (op.num_processes, op.local_mode) == ("2", "True")
    assert op.train_kwargs == {"lr": "0.1"}
    assert op.conf == {"spark.executor.memory": "2g"}
    spec = op.training_spec()
    assert (spec.num_processes, spec.local_mode) == (2, True)
    assert spec.conf == {"spark.executor.memory": "2g"}


def test_script_path_is_rendered(tmp_path):
    op = TorchDistributorOperator(task_id="t", train_object="{{ params.dir }}/train.py")
    op.render_template_fields({"params": {"dir": str(tmp_path)}})
    assert op.train_object == f"{tmp_path}/train.py"


# -- execute ------------------------------------------------------------------------------------


def _tensor_train(n, scale=1.0):
    return torch.arange(n) * scale


def test_execute_returns_xcom_value_and_pushes_metrics(faked_spark):
    op = TorchDistributorOperator(
        task_id="t",
        train_object=_tensor_train,
        args=[3],
        kwargs={"scale": 2.0},
        num_processes="{{ params.n }}",
        nproc_per_node=2,
        spark_submit_kwargs={"executor_memory": "1g"},
    )
    op.num_processes = "4"  # as rendered
    ti = FakeTI()
    value = op.execute({"ti": ti})
    assert value[ENVELOPE_KEY] == ENVELOPE_VERSION == 2
    assert (value["format"], value["type"]) == ("cloudpickle", "torch.Tensor")
    # Signed and bound to the task instance that produced it.
    assert output_origin(value) == {
        "dag_id": "d",
        "run_id": "manual__1",
        "task_id": "train",
        "map_index": -1,
        "try": 1,
    }
    assert torch.equal(load_output(value), torch.arange(3) * 2.0)
    assert torch.equal(load_output(value, expect={"run_id": "manual__1"}), torch.arange(3) * 2.0)
    with pytest.raises(OutputSignatureError, match="comes from run_id='manual__1'"):
        load_output(value, expect={"run_id": "manual__2"})
    # Every link key holds a URL or "" (Airflow logs a missing XCom at error level when it reads a link).
    assert ti.pushed == {
        METRICS_XCOM_KEY: [{"rank": 0, "step": 0, "loss": 1.0}],
        WORLD_SIZES_XCOM_KEY: [],
        "spark_ui_url": "",
        "spark_master_app_url": "",
        "spark_history_url": "",
        "mlflow_run_url": "",  # no mlflow_conn_id: the "MLflow run" link shows nothing
        # The run's checkpoint directory, for a downstream task (the task's own by default).
        CHECKPOINT_DIR_XCOM_KEY: op.default_checkpoint_dir({"ti": ti}),
        "checkpoints": [],  # the kept checkpoints, best first: this run saved none
    }
    spec = faked_spark.spec
    assert (spec.num_processes, spec.nproc_per_node) == (4, 2)
    [hook] = faked_spark.hooks
    assert hook.plan.submit_kwargs["executor_memory"] == "1g"
    # The checkpoint directory defaults to the task's own, the same for every try.
    assert spec.checkpoint_dir == hook.spec.checkpoint_dir == op.default_checkpoint_dir({"ti": ti})


def test_execute_returns_plain_json_as_is(faked_spark):
    op = _op(args=[21], kwargs={"scale": 2})
    assert op.execute({"ti": FakeTI()}) == 42


def test_execute_pushes_metrics_even_when_training_fails(faked_spark):
    faked_spark.outcome = Outcome(
        ok=False,
        failures=[RankFailure(rank=0, host="h", exc_type="RuntimeError", message="nan loss")],
        metrics=[{"rank": 0, "step": 5, "loss": float("nan")}],
    )
    ti = FakeTI()
    from airflow_provider_torchdist.errors import TrainingFailed

    with pytest.raises(TrainingFailed, match="nan loss"):
        _op().execute({"ti": ti})
    assert ti.pushed[METRICS_XCOM_KEY][0]["step"] == 5
    assert WORLD_SIZES_XCOM_KEY not in ti.pushed  # only a succeeded run's


ELASTIC_SIZES = [
    {"time": 1767225600.0, "world_size": 4, "reason": "start"},
    {"time": 1767225660.5, "world_size": 2, "reason": "lost node 1 (executor 3 on host-b)"},
    {"time": 1767225720, "world_size": 4, "reason": "node 1 rejoined"},
]


def test_a_succeeded_run_pushes_its_world_sizes(faked_spark):
    """From the driver's outcome through the supervisor's status to the hook and XCom."""
    faked_spark.outcome = Outcome(ok=True, world_sizes=ELASTIC_SIZES)
    ti = FakeTI()
    op = _op(num_processes="2:4", nproc_per_node=2)
    op.execute({"ti": ti})
    assert ti.pushed[WORLD_SIZES_XCOM_KEY] == ELASTIC_SIZES
    [hook] = faked_spark.hooks
    assert hook.world_sizes == ELASTIC_SIZES == hook.run_status.world_sizes
    assert (hook.spec.num_processes, hook.spec.min_nodes, hook.spec.num_nodes) == ("2:4", 1, 2)


def test_a_malformed_world_size_from_the_driver_is_left_out_not_fatal(faked_spark):
    faked_spark.outcome = Outcome(
        ok=True, world_sizes=[ELASTIC_SIZES[0], {"time": 1.0, "world_size": 0, "reason": "?"}, {"x": 1}]
    )
    ti = FakeTI()
    _op().execute({"ti": ti})
    assert ti.pushed[WORLD_SIZES_XCOM_KEY] == [ELASTIC_SIZES[0]]


def test_make_hook_passes_settings(tmp_path):
    op = _op(
        num_processes=4,
        nproc_per_node=2,
        max_restarts=2,
        conf={"spark.log.level": "INFO"},
        env_vars={"A": "1"},
        rank_env={"B": "2"},
        spark_submit_kwargs={"driver_memory": "3g"},
    )
    hook = op.make_hook()
    assert hook.spec == op.training_spec()
    assert (hook.spec.num_processes, hook.spec.nproc_per_node, hook.spec.max_restarts) == (4, 2, 2)
    assert hook.spec.rank_env == {"B": "2"}
    plan = plan_without_a_run(hook, tmp_path)
    assert plan.properties["spark.log.level"] == "INFO"
    assert plan.env["A"] == "1"
    assert plan.submit_kwargs["driver_memory"] == "3g"


def test_make_hook_with_a_context_uses_the_tasks_checkpoint_dir():
    ti = FakeTI()
    op = _op()
    assert op.make_hook().spec.checkpoint_dir is None
    assert op.make_hook({"ti": ti}).spec.checkpoint_dir == op.default_checkpoint_dir({"ti": ti})
    assert _op(checkpoint_dir="/ckpt").make_hook({"ti": ti}).spec.checkpoint_dir == "/ckpt"


@pytest.mark.parametrize("state, stopped", [("error", True), ("gone", False)])
def test_execute_complete_after_a_failed_wait_fails_and_stops_a_run_still_there(monkeypatch, state, stopped):
    from airflow_provider_torchdist.errors import SparkSubmitFailed
    from airflow_provider_torchdist.operators import run_control as operator_module
    from airflow_provider_torchdist.supervision.record import RunRecord

    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    ended: list[RunRecord] = []
    monkeypatch.setattr(operator_module, "end_run", ended.append)
    event = {"state": state, "message": "the trigger failed: boom", "record": record.to_dict()}
    with pytest.raises(SparkSubmitFailed, match="the trigger failed: boom" if state == "error" else "boom"):
        _op().execute_complete({"ti": FakeTI()}, event)
    # An error leaves a live run nobody comes back for: stopped. A gone run has nothing to stop.
    assert ended == ([record] if stopped else [])


@pytest.mark.parametrize("retries, stopped", [(0, True), (1, False)])
def test_a_task_failing_while_it_owns_the_run_stops_it_unless_a_retry_comes(monkeypatch, retries, stopped):
    from types import SimpleNamespace

    from airflow_provider_torchdist.errors import SparkSubmitFailed
    from airflow_provider_torchdist.supervision import task_side as run_owner
    from airflow_provider_torchdist.supervision.record import RunRecord

    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    ended: list[RunRecord] = []
    monkeypatch.setattr(run_owner, "end_run", ended.append)

    def follow(record, handle, **options):
        raise SparkSubmitFailed("the lifeline broke while fetching the output")

    op = _op(retries=retries)
    op._hook = SimpleNamespace(follow=follow, metrics=[], spec=op.training_spec(), on_application=None)
    with pytest.raises(SparkSubmitFailed, match="lifeline broke"):
        op._follow(record, {"ti": FakeTI()}, ended=False)  # try 1
    # No retry to come back for it: stopped now, not kept for reattach_timeout. A retry reattaches.
    assert ended == ([record] if stopped else [])


def test_a_retry_that_finds_the_supervisor_gone_ends_what_the_run_left_on_a_connect_server(monkeypatch):
    from types import SimpleNamespace

    from airflow_provider_torchdist.operators import run_control as operator_module
    from airflow_provider_torchdist.supervision.record import RunRecord

    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    monkeypatch.setattr(operator_module, "run_state", lambda r: "gone")
    lost: list[RunRecord] = []
    op = _op()
    op._hook = SimpleNamespace(end_lost_run=lost.append)
    assert op.get_job_status(record.to_dict(), {}) == "gone"  # the mixin then starts afresh
    assert lost == [record]

    def unreachable(record):
        raise OSError("connection refused")

    op._hook = SimpleNamespace(end_lost_run=unreachable)
    assert op.get_job_status(record.to_dict(), {}) == "gone"  # said as a warning; the new run goes on


OPERATION = "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"


def _follow_with_operation(store) -> tuple:
    """``_follow`` of a run whose app event names OPERATION, with ``store`` as the task's state store;
    returns the record followed and what ``_follow`` returned."""
    from types import SimpleNamespace

    from airflow_provider_torchdist.supervision.record import RunRecord

    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    op = _op()

    def follow(record, handle, **options):
        hook.on_operation(OPERATION)  # what the run's app event calls
        return "value"

    hook = SimpleNamespace(
        follow=follow,
        metrics=[],
        spec=op.training_spec(),
        on_application=None,
        on_operation=None,
        world_sizes=[],
        run_status=None,
    )
    op._hook = hook
    return record, op._follow(record, {"ti": FakeTI(), "task_state_store": store}, ended=False)


def test_a_connect_runs_operation_joins_the_record_in_the_task_state_store():
    from types import SimpleNamespace

    from airflow_provider_torchdist.supervision.record import RECORD_KEY, RunRecord

    stored: dict = {}
    record, _ = _follow_with_operation(SimpleNamespace(set=stored.__setitem__))
    assert RunRecord.from_dict(stored[RECORD_KEY]) == record.with_operation(OPERATION)


def test_a_failed_write_of_the_operation_to_the_state_store_does_not_fail_the_run():
    from types import SimpleNamespace

    def unavailable(key, value):
        raise RuntimeError("state store: 503")

    assert _follow_with_operation(SimpleNamespace(set=unavailable))[1] == "value"


def test_an_owner_hands_a_connect_runs_operation_from_its_app_event_to_the_hook():
    from airflow_provider_torchdist import TorchDistributorHook
    from airflow_provider_torchdist.supervision.lifeline import AppEvent, DoneEvent, RunStatus
    from airflow_provider_torchdist.supervision.task_side import follow_to_end

    events = [AppEvent("local-1", None, OPERATION), DoneEvent(RunStatus("succeeded"))]
    owner = type("Owner", (), {"events": lambda self: iter(events)})()
    hook = TorchDistributorHook(num_processes=2)
    links, operations = [], []
    hook.on_application, hook.on_operation = links.append, operations.append
    status = follow_to_end(owner, "run-1", on_line=print, on_application=hook._application_started)
    assert status.state == "succeeded"
    assert [link.app_id for link in links] == ["local-1"] and operations == [OPERATION]


def test_a_deferred_run_whose_supervisor_is_gone_has_its_connect_job_interrupted(monkeypatch):
    from types import SimpleNamespace

    from airflow_provider_torchdist.errors import SparkSubmitFailed
    from airflow_provider_torchdist.supervision.record import RunRecord

    record = RunRecord(run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0)
    lost: list[RunRecord] = []
    op = _op()
    monkeypatch.setattr(op, "make_hook", lambda context: SimpleNamespace(end_lost_run=lost.append))
    event = {"state": "gone", "message": "no supervisor answered", "record": record.to_dict()}
    with pytest.raises(SparkSubmitFailed, match="no supervisor answered"):
        op.execute_complete({"ti": FakeTI()}, event)
    assert lost == [record]


# -- execution_timeout over the whole run (run_timeout) --------------------------------------------


def _record(**fields):
    from airflow_provider_torchdist.supervision.record import RunRecord

    return RunRecord(
        run_id="run-1", host="127.0.0.1", port=40123, durable=True, reattach_timeout=600.0, **fields
    )


def test_a_runs_deadline_is_its_tries_start_plus_execution_timeout():
    import datetime as dt
    from types import SimpleNamespace

    from airflow_provider_torchdist.supervision.record import RunRecord

    started = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ti = FakeTI()
    ti.start_date = started
    op = _op(execution_timeout=dt.timedelta(seconds=45))
    op._hook = SimpleNamespace(start_run=lambda *a, **k: _record(), spec=op.training_spec())
    record = RunRecord.from_dict(op.submit_job({"ti": ti}))
    assert record.deadline == started.timestamp() + 45
    op = _op()  # no execution_timeout: no deadline
    op._hook = SimpleNamespace(start_run=lambda *a, **k: _record(), spec=op.training_spec())
    assert RunRecord.from_dict(op.submit_job({"ti": ti})).deadline is None


class WatchedHook:
    """What ``_follow`` uses of the hook: ``follow`` trains until ``stop_run`` (the real hook's
    answer: False once the run has ended) or until it is told to finish."""

    def __init__(self, op, ended_first=False):
        import threading

        self.stopped, self.finish = threading.Event(), threading.Event()
        self.stops, self.ended_first = [], ended_first
        self.metrics, self.world_sizes, self.run_status = [], [], None
        self.spec, self.on_application = op.training_spec(), None

    def follow(self, record, handle, **options):
        from airflow_provider_torchdist.errors import SparkSubmitFailed

        if self.ended_first:  # the run has ended: its output is being fetched when the deadline passes
            self.run_status = "succeeded"
            assert self.finish.wait(10)
            return {"ok": 1}
        assert self.stopped.wait(10), "the run was never stopped"
        raise SparkSubmitFailed("the run failed: stopped by its owner")

    def stop_run(self, record):
        self.stops.append(record.run_id)
        if self.run_status is not None:
            return False
        self.stopped.set()
        return True


def test_a_run_past_its_deadline_while_followed_is_stopped_and_the_try_times_out():
    import time

    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    op = _op()
    op._hook = hook = WatchedHook(op)
    started = time.monotonic()
    with pytest.raises(AirflowTaskTimeout, match="Run run-1 passed the task's execution_timeout"):
        op._follow(_record(deadline=time.time() + 0.5), {"ti": FakeTI()}, ended=False)
    assert 0.4 < time.monotonic() - started < 5
    assert hook.stops == ["run-1"]


def test_a_run_that_ended_before_its_deadline_keeps_its_result_while_it_is_fetched():
    import threading
    import time

    op = _op()
    op._hook = hook = WatchedHook(op, ended_first=True)
    threading.Timer(1.0, hook.finish.set).start()  # the fetch outlasts the deadline
    assert op._follow(_record(deadline=time.time() + 0.3), {"ti": FakeTI()}, ended=False) == {"ok": 1}
    assert hook.stops == ["run-1"]  # asked, and it said there was nothing to stop


def test_a_run_known_to_have_ended_is_not_held_to_its_deadline():
    import time

    op = _op()
    op._hook = hook = WatchedHook(op, ended_first=True)
    hook.finish.set()
    assert op._follow(_record(deadline=time.time() - 5), {"ti": FakeTI()}, ended=True) == {"ok": 1}
    assert hook.stops == []


def test_a_run_already_past_its_deadline_is_stopped_before_it_is_followed(monkeypatch):
    import time

    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    from airflow_provider_torchdist.operators import run_control as operator_module

    ended = []
    whys: list[str | None] = []
    monkeypatch.setattr(
        operator_module, "end_run", lambda r, timeout, why: ended.append(r.run_id) or whys.append(why)
    )
    op = _op()
    op._hook = hook = WatchedHook(op)
    with pytest.raises(AirflowTaskTimeout, match="before this try could take it over"):
        op._follow(_record(deadline=time.time() - 5), {"ti": FakeTI()}, ended=False)
    assert ended == ["run-1"] and hook.stops == []
    assert whys == ["timeout"]  # what the ranks are told


def test_execute_complete_after_a_timeout_event_makes_sure_the_run_ended_then_times_out(monkeypatch):
    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    from airflow_provider_torchdist.operators import run_control as operator_module

    record = _record(deadline=1767225600.0)
    ended = []
    whys: list[str | None] = []
    monkeypatch.setattr(
        operator_module, "end_run", lambda r, timeout, why: ended.append(r) or whys.append(why)
    )
    event = {"state": "timeout", "message": "...", "record": record.to_dict()}
    with pytest.raises(
        AirflowTaskTimeout, match=r"Run run-1 .*2026-01-01T00:00:00\+00:00.* while the task was deferred"
    ):
        _op().execute_complete({"ti": FakeTI()}, event)
    assert ended == [record]
    assert whys == ["timeout"]  # what the ranks are told


def test_a_timeout_events_stop_report_is_in_the_tasks_error(monkeypatch):
    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    from airflow_provider_torchdist.operators import run_control as operator_module

    monkeypatch.setattr(operator_module, "end_run", lambda r, timeout, why: None)
    report = "stopped (timeout); the ranks ended 1.2 s after the stop request (grace period 10 s)"
    record = _record(deadline=1767225600.0).to_dict()
    for given, said in ((report, f"How the stop went: {report}."), (None, ""), ("", "")):
        event = {"state": "timeout", "message": "...", "record": record, "stop_report": given}
        with pytest.raises(AirflowTaskTimeout) as raised:
            _op().execute_complete({"ti": FakeTI()}, event)
        assert said in str(raised.value)
        assert ("How the stop went" in str(raised.value)) == bool(said)


def test_airflows_own_trigger_timeout_stops_the_run_from_its_record_then_times_out(monkeypatch):
    from airflow.providers.common.compat.sdk import AirflowTaskTimeout

    from airflow_provider_torchdist.operators import run_control as operator_module

    record = _record(deadline=1767225600.0)
    ended = []
    whys: list[str | None] = []
    monkeypatch.setattr(
        operator_module, "end_run", lambda r, timeout, why: ended.append(r) or whys.append(why)
    )
    store = {"torchdist_run": record.to_dict()}
    context = {"ti": FakeTI(), "task_state_store": store}
    with pytest.raises(AirflowTaskTimeout, match="Run run-1"):
        _op().resume_execution("__fail__", {"error": "Trigger timeout"}, context)
    assert ended == [record]
    assert whys == ["timeout"]  # what the ranks are told
    # Another trigger failure is Airflow's to raise, as before (TaskDeferralError, which Airflow
    # 3.0 keeps in airflow.exceptions and 3.3 in airflow.sdk.exceptions).
    with pytest.raises(Exception) as failed:
        _op().resume_execution("__fail__", {"error": "Trigger failure"}, context)
    assert type(failed.value).__name__ == "TaskDeferralError"
    assert ended == [record]


# -- dynamic task mapping (a MappedOperator renders through Airflow's own code, not ours) ---------


def _fit(gate, *, lr=0.1):
    raise AssertionError("rendering must never call the training callable")


def _other_fit(gate, *, lr=0.1):
    raise AssertionError("rendering must never call the training callable")


def _render_mapped(map_index: int, mapping: Any, **partial: Any) -> TorchDistributorOperator:
    """The task Airflow's MappedOperator renders for ``map_index`` of ``mapping(partial(...))``."""
    from types import SimpleNamespace

    import pendulum
    from airflow.sdk import DAG

    with DAG("d", schedule=None, start_date=pendulum.datetime(2026, 1, 1), params={"g": "/tmp/g"}) as dag:
        mapped = mapping(
            TorchDistributorOperator.partial(
                task_id="train", args=["{{ params.g }}"], local_mode=True, **partial
            )
        )
    ti = SimpleNamespace(map_index=map_index, task=mapped, run_id="r", dag_id="d", task_id="train")
    context = {"ti": ti, "task": mapped, "dag": dag, "dag_run": SimpleNamespace(conf={})}
    mapped.render_template_fields(context)
    return context["task"]


@pytest.mark.parametrize(
    "partial, mapping, expected",
    [
        (  # the sweep: a callable, its keyword arguments mapped
            {"train_object": _fit},
            lambda p: p.expand(kwargs=[{"lr": 0.1}, {"lr": 0.05}]),
            {"train_object": _fit, "train_kwargs": {"lr": 0.05}},
        ),
        (
            {"train_object": _fit},
            lambda p: p.expand_kwargs(
                [{"kwargs": {"lr": 0.3}, "num_processes": 1}, {"kwargs": {"lr": 0.5}, "num_processes": 3}]
            ),
            {"train_object": _fit, "train_kwargs": {"lr": 0.5}, "num_processes": 3},
        ),
        (  # the train object itself: a callable and a (templated) script
            {},
            lambda p: p.expand(train_object=[_other_fit, "{{ params.g }}/train.py"]),
            {"train_object": "/tmp/g/train.py"},
        ),
        (  # a cross product: index 1 is the first callable with the second conf
            {},
            lambda p: p.expand(train_object=[_other_fit, _fit], conf=[{"a": "1"}, {"spark.task.cpus": "2"}]),
            {"train_object": _other_fit, "conf": {"spark.task.cpus": "2"}},
        ),
    ],
)
def test_a_mapped_task_renders_and_never_calls_its_callable(partial, mapping, expected):
    task = _render_mapped(1, mapping, **partial)
    assert task.train_args == ["/tmp/g"]
    for name, value in expected.items():
        assert getattr(task, name) == value, name
    assert task.training_spec().local_mode is True


def test_the_hooks_stop_at_the_deadline_stops_a_run_still_going_and_nothing_ended(monkeypatch):
    import dataclasses

    from airflow_provider_torchdist.hooks import supervised as hook_module
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook

    ended = []
    whys: list[str | None] = []
    monkeypatch.setattr(
        hook_module, "end_run", lambda r, timeout, why: ended.append(r.run_id) or whys.append(why)
    )
    hook = TorchDistributorHook(spec=_op().training_spec())
    assert hook.stop_run(_record()) is True and ended == ["run-1"]  # not owned here: a new lifeline
    assert whys == ["timeout"]  # what the ranks are told

    class Owner:
        stops = 0

        def stop(self, why=None):
            Owner.stops += 1
            whys.append(why)

    hook._owner, hook.record = Owner(), _record()
    # The record the operator holds has gained a deadline since: still the same run, same lifeline.
    assert hook.stop_run(dataclasses.replace(_record(), deadline=1767225600.0)) is True
    assert Owner.stops == 1 and ended == ["run-1"] and whys == ["timeout", "timeout"]
    hook.run_status = object()  # the run has ended: its result is on its way, nothing to stop
    assert hook.stop_run(_record()) is False and Owner.stops == 1


def test_follow_keeps_the_lifeline_start_run_opened_when_the_record_gained_a_deadline(monkeypatch):
    import dataclasses

    from airflow_provider_torchdist.hooks import supervised as hook_module
    from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook

    def no_new_lifeline(*args, **kwargs):
        raise AssertionError("follow opened a second lifeline to the run it owns")

    monkeypatch.setattr(hook_module, "connect_owner", no_new_lifeline)

    class Owner:
        status = None

        def close(self):
            pass

    hook = TorchDistributorHook(spec=_op().training_spec())
    hook._owner, hook.record = Owner(), _record()
    # Past the choice of lifeline, the fake owner has no status: follow stops there.
    with pytest.raises(AttributeError):
        hook.follow(dataclasses.replace(_record(), deadline=1767225600.0), lambda path: None)


@pytest.mark.parametrize(
    "was, now, cleared", [(0, 1, True), (1, 1, False), (None, 3, False), (2, None, False)]
)
def test_a_run_whose_task_was_cleared_since_it_started_is_stopped_not_reattached_to(
    monkeypatch, was, now, cleared
):
    """Airflow raises max_tries when a user clears a task (a retry keeps it): a clear asks for a
    new run, even when the old one is still going (a deferred task's trigger stops it later)."""
    from airflow_provider_torchdist.operators import run_control as operator_module

    ended = []
    whys: list[str | None] = []
    monkeypatch.setattr(operator_module, "end_run", lambda r, why: ended.append(r.run_id) or whys.append(why))
    monkeypatch.setattr(operator_module, "run_state", lambda r: "running")
    ti = FakeTI()
    ti.max_tries = now
    op = _op()
    state = op.get_job_status(_record(max_tries=was).to_dict(), {"ti": ti})
    assert (state, ended) == (("cleared", ["run-1"]) if cleared else ("running", []))
    assert op.is_job_active(state) is not cleared and not op.is_job_succeeded(state)


def test_a_run_records_the_tasks_max_tries():
    from types import SimpleNamespace

    from airflow_provider_torchdist.supervision.record import RunRecord

    ti = FakeTI()
    ti.max_tries = 3
    op = _op()
    op._hook = SimpleNamespace(start_run=lambda *a, **k: _record(), spec=op.training_spec())
    assert RunRecord.from_dict(op.submit_job({"ti": ti})).max_tries == 3
