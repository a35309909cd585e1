"""The Training view's status credential (issue 40): it asks a run's status and nothing else.

A real supervisor reads both credentials from its ``supervisor.json`` (as the task writes it), and
the view, holding only ``[torchdist] view_status_key`` (no signing key), asks it over the real
lifeline. The status credential offered as an owner (``task`` or ``trigger``: stop, follow, fetch)
is refused. Before, the view asked with the owner's credential, derived from the master key the
API server had to hold.
"""

from __future__ import annotations

import threading

import pytest

from airflow_provider_torchdist.outputs.signing import status_view_key
from airflow_provider_torchdist.supervision.lifeline import (
    LifelineError,
    LifelineServer,
    OwnerConnection,
    query_status,
)
from airflow_provider_torchdist.supervision.record import (
    RunRecord,
    TaskBinding,
    owner_secret,
    status_secret,
)
from airflow_provider_torchdist.supervision.supervisor import RunSupervisor, SupervisorConfig
from tests.unit.supervision.test_supervisor import FakeRun

MASTER = b"m" * 40
RUN = "run-status-1"
TI = TaskBinding("dag", "run", "train", -1)
VIEW_KEY = status_view_key(MASTER)
OWNER = owner_secret(RUN, MASTER, TI)
STATUS = status_secret(RUN, VIEW_KEY, TI)


def supervisor_json(durable: bool) -> dict:
    """``supervisor.json`` as the task writes it, less the status credential."""
    return {
        "run_id": RUN,
        "durable": durable,
        "reattach_timeout": 30.0,
        "bind_host": "127.0.0.1",
        "checkpoint_dir": None,
        "owner_secret_hex": OWNER.hex(),
        "output_file": None,
        "stop_grace_period": 0.0,
    }


@pytest.fixture
def supervisor(tmp_path):
    """A real supervisor of a running run, configured from ``supervisor.json``'s fields."""
    staging = tmp_path / "torchdist-run"
    staging.mkdir(mode=0o700)
    config = SupervisorConfig.from_dict({**supervisor_json(durable=True), "status_secret_hex": STATUS.hex()})
    assert config.status_secret == STATUS
    run = FakeRun()
    sup = RunSupervisor(
        staging, config, make_run=lambda: run, follow=False, silence_s=5.0, ping_interval=0.05
    )
    host, port = sup.listen()
    thread = threading.Thread(target=sup.serve, daemon=True)
    thread.start()
    assert run.started.wait(5)
    yield host, port
    sup.request_teardown("test over")
    run.end()
    thread.join(10)


def test_the_status_credential_asks_status_and_can_do_nothing_else(supervisor):
    host, port = supervisor
    assert query_status(host, port, RUN, STATUS).state == "running"
    for kind in ("task", "trigger"):  # owning: stop, follow, fetch the output
        with pytest.raises(LifelineError, match="refused"):
            OwnerConnection(host, port, RUN, STATUS, kind=kind)
    # Bound to the task instance: another instance's status credential proves nothing here.
    with pytest.raises(LifelineError, match="refused"):
        query_status(host, port, RUN, status_secret(RUN, VIEW_KEY, TaskBinding("dag", "run", "other", -1)))
    # The owner's credential still reads the status (a retry's reattach check does).
    assert query_status(host, port, RUN, OWNER).state == "running"


def test_the_view_with_only_the_status_key_shows_the_live_run(supervisor, monkeypatch, tmp_path):
    """The API server's configuration: ``view_status_key`` only, no signing key, no key file."""
    from airflow_provider_torchdist.ui import task_facts

    host, port = supervisor
    home = tmp_path / "api-server-home"
    home.mkdir()
    monkeypatch.setenv("AIRFLOW_HOME", str(home))
    monkeypatch.delenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW__TORCHDIST__VIEW_STATUS_KEY", VIEW_KEY.hex())
    monkeypatch.setattr(task_facts, "_cache", {})
    record = RunRecord(run_id=RUN, host=host, port=port, durable=True, reattach_timeout=30.0).to_dict()
    assert task_facts.live_history(record, TI) == []  # live (no metrics yet), not None
    assert list(home.iterdir()) == []  # no signing key made or needed
    # A view key of another deployment gets nothing.
    monkeypatch.setattr(task_facts, "_cache", {})
    monkeypatch.setenv("AIRFLOW__TORCHDIST__VIEW_STATUS_KEY", status_view_key(b"o" * 40).hex())
    assert task_facts.live_history(record, TI) is None
    # Backward compatible: an API server with the signing key derives the view key itself.
    monkeypatch.setattr(task_facts, "_cache", {})
    monkeypatch.delenv("AIRFLOW__TORCHDIST__VIEW_STATUS_KEY")
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", MASTER.decode())
    assert task_facts.live_history(record, TI) == []


def test_a_server_without_a_status_credential_refuses_one():
    server = LifelineServer(RUN, OWNER, "127.0.0.1")
    server.start()
    try:
        with pytest.raises(LifelineError, match="refused"):
            query_status(*server.address, RUN, STATUS)
        assert query_status(*server.address, RUN, OWNER).state == "starting"
    finally:
        server.close("test over")


def test_supervisor_json_without_a_status_credential_still_reads():
    base = supervisor_json(durable=False)
    assert SupervisorConfig.from_dict(base).status_secret is None
    from airflow_provider_torchdist.supervision.config import SupervisorStartError

    with pytest.raises(SupervisorStartError, match="status_secret_hex"):
        SupervisorConfig.from_dict({**base, "status_secret_hex": "ab" * 8})
