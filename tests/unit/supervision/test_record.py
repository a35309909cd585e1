"""The run record in task_state_store: what it holds, what it refuses, and the derived credential."""

from __future__ import annotations

import json

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.supervision.record import RECORD_VERSION, RunRecord, TaskBinding, owner_secret

GOOD = RunRecord(run_id="abc123", host="127.0.0.1", port=4242, durable=True, reattach_timeout=600.0)


def test_a_record_round_trips_through_json_and_holds_no_secret():
    data = json.loads(json.dumps(GOOD.to_dict()))
    assert RunRecord.from_dict(data) == GOOD
    assert set(data) == {
        "run_id",
        "host",
        "port",
        "durable",
        "reattach_timeout",
        "version",
        "provider_version",
        "connect_session_id",
        "connect_operation_id",
        "deadline",
        "max_tries",
    }
    assert data["connect_session_id"] is None and data["connect_operation_id"] is None


SESSION, OPERATION = "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10", "5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"


def test_a_connect_runs_operation_joins_its_record_and_round_trips():
    record = GOOD.with_operation(f"{SESSION}/{OPERATION}")
    assert (record.connect_session_id, record.connect_operation_id) == (SESSION, OPERATION)
    assert record.connect_operation == f"{SESSION}/{OPERATION}"
    assert RunRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert GOOD.connect_operation is None


def test_a_connect_runs_session_is_recorded_from_its_start_before_any_operation():
    record = GOOD.with_session(SESSION)
    assert (record.connect_session_id, record.connect_operation_id, record.connect_operation) == (
        SESSION,
        None,
        None,
    )
    assert RunRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    with pytest.raises(ValueError, match="not a Spark Connect session id"):
        GOOD.with_session("mine")


def test_a_record_of_a_release_before_connect_operations_is_still_read():
    data = GOOD.to_dict()
    del data["connect_session_id"], data["connect_operation_id"]
    assert RunRecord.from_dict(data) == GOOD


@pytest.mark.parametrize("operation", ["", SESSION, f"{SESSION}/", f"/{OPERATION}", f"{SESSION}/x", "a/b/c"])
def test_what_is_not_a_connect_operation_is_refused(operation):
    with pytest.raises(ValueError, match="not a Spark Connect operation"):
        GOOD.with_operation(operation)


@pytest.mark.parametrize(
    "change",
    [
        {"run_id": ""},
        {"run_id": 5},
        {"host": ""},
        {"port": 0},
        {"port": 70000},
        {"port": True},
        {"port": "4242"},
        {"durable": 1},
        {"durable": "yes"},
        {"reattach_timeout": 0},
        {"reattach_timeout": -1.0},
        {"reattach_timeout": "600"},
        {"reattach_timeout": True},
        {"reattach_timeout": float("nan")},
        {"connect_operation_id": OPERATION},
        {"connect_session_id": "", "connect_operation_id": OPERATION},
        {"connect_session_id": SESSION, "connect_operation_id": "not-a-uuid"},
        {"connect_session_id": 5, "connect_operation_id": OPERATION},
        {"deadline": "1767225600"},
        {"deadline": True},
        {"deadline": 0},
        {"deadline": -5.0},
        {"deadline": float("inf")},
        {"deadline": float("nan")},
        {"deadline": [1.0]},
        {"deadline": 1e300},
        {"max_tries": -1},
        {"max_tries": True},
        {"max_tries": "1"},
        {"max_tries": 1.0},
    ],
)
def test_a_malformed_record_is_refused(change):
    with pytest.raises(InvalidTrainingConfig, match="malformed"):
        RunRecord.from_dict({**GOOD.to_dict(), **change})


def test_a_records_deadline_round_trips_and_a_record_before_deadlines_is_still_read():
    record = RunRecord.from_dict({**GOOD.to_dict(), "deadline": 1767225600.5})
    assert record.deadline == 1767225600.5
    assert RunRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    data = GOOD.to_dict()
    del data["deadline"]
    assert RunRecord.from_dict(data).deadline is None


@pytest.mark.parametrize("data", [None, [], "abc", {}, {"run_id": "abc123"}])
def test_something_else_is_not_taken_for_a_record(data):
    with pytest.raises(InvalidTrainingConfig, match="not one this provider wrote"):
        RunRecord.from_dict(data)


def test_a_record_of_another_version_is_refused_naming_both_versions():
    data = {**GOOD.to_dict(), "version": RECORD_VERSION + 1, "provider_version": "9.9.9"}
    with pytest.raises(InvalidTrainingConfig, match=r"9\.9\.9.*cannot reattach"):
        RunRecord.from_dict(data)


def test_the_owner_credential_is_derived_per_run_and_per_key():
    key, other = b"k" * 32, b"o" * 32
    assert owner_secret("run-a", key) == owner_secret("run-a", key)
    assert len(owner_secret("run-a", key)) == 32
    assert owner_secret("run-a", key) != owner_secret("run-b", key)
    assert owner_secret("run-a", key) != owner_secret("run-a", other)


# -- the task instance a run belongs to -------------------------------------------------------------

TASK = TaskBinding("train_dag", "scheduled__2026-11-26", "train", 3)


def test_the_credential_is_bound_to_the_task_instance_not_the_try():
    key = b"k" * 32
    bound = owner_secret("abc123", key, TASK)
    assert bound != owner_secret("abc123", key)  # a run started outside a task
    for other in (
        TaskBinding("other_dag", TASK.run_id, TASK.task_id, TASK.map_index),
        TaskBinding(TASK.dag_id, "manual__x", TASK.task_id, TASK.map_index),
        TaskBinding(TASK.dag_id, TASK.run_id, "evaluate", TASK.map_index),
        TaskBinding(TASK.dag_id, TASK.run_id, TASK.task_id, -1),
        # The parts are not run together: no other split of the same characters gives the same key.
        TaskBinding("train_dag|scheduled__2026-11-26", "x", "train", 3),
    ):
        assert owner_secret("abc123", key, other) != bound, other

    class TryOne:
        dag_id, run_id, task_id, map_index, try_number = "train_dag", "scheduled__2026-11-26", "train", 3, 1

    class TryTwo(TryOne):
        try_number = 2

    assert TaskBinding.of(TryOne()) == TaskBinding.of(TryTwo()) == TASK  # a retry owns its run
    assert GOOD.bound_to(TASK).secret(key) == bound


def test_the_binding_is_never_stored_nor_read_from_a_stored_record():
    bound = GOOD.bound_to(TASK)
    assert "task" not in bound.to_dict()
    # A record carrying a task of its own (hand-made, or copied from elsewhere): ignored, so the
    # holder's own task instance is what its credential is bound to.
    read = RunRecord.from_dict({**bound.to_dict(), "task": TASK.to_dict()})
    assert read.task is None


def test_a_record_before_task_binding_is_refused_saying_to_clear_it():
    data = {**GOOD.to_dict(), "version": 1, "provider_version": "0.0.9"}
    with pytest.raises(InvalidTrainingConfig, match="version 1.*Clear the task's state"):
        RunRecord.from_dict(data)


@pytest.mark.parametrize(
    "data",
    [
        None,
        {"dag_id": "d", "run_id": "r", "task_id": "t"},
        {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": "3"},
        {"dag_id": "", "run_id": "r", "task_id": "t", "map_index": -1},
        {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1, "try_number": 1},
    ],
)
def test_a_malformed_binding_is_refused(data):
    with pytest.raises(ValueError, match="task binding"):
        TaskBinding.from_dict(data)


def test_what_is_not_a_task_instance_binds_nothing():
    assert TaskBinding.of(None) is None
    assert TaskBinding.of(object()) is None


def test_a_record_copied_into_another_task_instances_state_gets_no_status_from_the_run():
    """The view and a retry bind the record to the task instance they stand for: the run's
    supervisor, which holds its own task instance's credential, refuses the other's."""
    from airflow_provider_torchdist.supervision.lifeline import (
        LifelineError,
        LifelineServer,
        RunState,
        query_status,
    )

    class Nobody:
        def owner_attached(self, owner):
            pass

        def owner_lost(self, owner, why):
            pass

        def command(self, owner, name):
            return None

    key = b"k" * 32
    server = LifelineServer("abc123", owner_secret("abc123", key, TASK), "127.0.0.1", RunState(), Nobody())
    server.start()
    try:
        host, port = server.address
        record = RunRecord(run_id="abc123", host=host, port=port, durable=True, reattach_timeout=60.0)
        assert query_status(host, port, "abc123", record.bound_to(TASK).secret(key)).state == "starting"
        elsewhere = record.bound_to(TaskBinding("train_dag", "scheduled__2026-11-26", "train", 4))
        with pytest.raises(LifelineError, match="credentials were refused"):
            query_status(host, port, "abc123", elsewhere.secret(key))
    finally:
        server.close("test over", timeout=0.5)
