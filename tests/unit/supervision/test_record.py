"""The run record in task_state_store: what it holds, what it refuses, and the derived credential."""

from __future__ import annotations

import json

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.supervision.record import RECORD_VERSION, RunRecord, owner_secret

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
