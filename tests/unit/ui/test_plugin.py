"""The Training view (the ``torchdist`` plugin): its figures, where its history comes from, and its
app through FastAPI's TestClient, authenticated by Airflow's own security dependencies with a fake
auth manager (no metadata DB: the task facts come from a fake reader)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest

from airflow_provider_torchdist.supervision.record import TaskBinding
from airflow_provider_torchdist.ui.figures import charted_records, progress, training_figures
from airflow_provider_torchdist.ui.plugin import has_external_views
from airflow_provider_torchdist.ui.task_facts import (
    TaskFacts,
    is_training_task,
    metric_history,
    world_size_of,
)

RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def reports(n: int, total: int | None = 10, rank: int = 0, t0: float = 100.0) -> list[dict[str, Any]]:
    """``n`` records of steps 0.. one 2 s apart, as report(step=..., total_steps=total, loss=...) makes them."""
    records = []
    for step in range(n):
        record: dict[str, Any] = {"rank": rank, "step": step, "time": t0 + 2.0 * step}
        if total is not None:
            record["total_steps"] = total
        records.append(record | {"loss": 1.0 / (step + 1), "lr": 0.1})
    return records


# -- figures --------------------------------------------------------------------------------------


def test_figures_of_a_run_half_way():
    figures = training_figures("running", reports(4), world_size=2, source="live")
    assert figures["state"] == "running" and figures["world_size"] == 2 and figures["source"] == "live"
    assert figures["metrics"][0] == {"step": 0, "time": 100.0, "loss": 1.0, "lr": 0.1}
    assert [m["step"] for m in figures["metrics"]] == [0, 1, 2, 3]
    assert all("rank" not in m and "total_steps" not in m for m in figures["metrics"])
    # Step 3 of range(10): 4 steps done, 2 s a step, 6 left.
    assert figures["progress"] == {"step": 3, "total_steps": 10, "fraction": 0.4, "eta_seconds": 12.0}


def test_progress_at_the_end_and_after_a_failure():
    assert progress(reports(10), "running")["fraction"] == 1.0
    assert progress(reports(10), "running")["eta_seconds"] == 0.0
    assert progress(reports(3), "success")["eta_seconds"] == 0.0  # ended early: nothing left
    assert progress(reports(3), "failed") == {
        "step": 2,
        "total_steps": 10,
        "fraction": 0.3,
        "eta_seconds": None,
    }


def test_progress_without_total_steps_or_time_per_step():
    assert progress(reports(3, total=None), "running") == {
        "step": 2,
        "total_steps": None,
        "fraction": None,
        "eta_seconds": None,
    }
    assert progress(reports(1), "running")["eta_seconds"] is None  # one record: no time per step yet
    assert progress([], "running") == {
        "step": None,
        "total_steps": None,
        "fraction": None,
        "eta_seconds": None,
    }
    # The latest record with total_steps counts, even when later ones leave it out.
    mixed = reports(3) + [{"rank": 0, "step": 3, "time": 106.0, "loss": 0.2}]
    assert progress(mixed, "running")["step"] == 2


def test_the_charted_rank_is_rank_zero_else_the_lowest():
    both = reports(2, rank=1) + reports(3, rank=0)
    assert [r["rank"] for r in charted_records(both)] == [0, 0, 0]
    assert {r["rank"] for r in charted_records(reports(2, rank=3) + reports(2, rank=1))} == {1}
    assert charted_records(["junk", None, *reports(1)]) == reports(1)


def test_values_json_cannot_carry_are_null():
    history = [{"rank": 0, "step": 0, "time": 1.0, "loss": float("nan"), "grad": float("inf"), "ok": 2}]
    assert training_figures("running", history, None, "xcom")["metrics"] == [
        {"step": 0, "time": 1.0, "loss": None, "grad": None, "ok": 2}
    ]


def test_world_size_is_the_rendered_num_processes():
    assert world_size_of({"num_processes": 4}) == 4
    assert world_size_of({"num_processes": "2"}) == 2  # a rendered template
    assert world_size_of({"num_processes": "{{ x }}"}) is None
    assert (
        world_size_of({}) is None
        and world_size_of(None) is None
        and world_size_of({"num_processes": True}) is None
    )


def test_an_elastic_runs_world_size_is_its_max():
    assert world_size_of({"num_processes": "2:4"}) == 4
    assert world_size_of({"num_processes": " 2 : 4 "}) == 4
    assert (
        world_size_of({"num_processes": "1:2:3"}) is None and world_size_of({"num_processes": "2:"}) is None
    )


# -- where the history comes from -----------------------------------------------------------------

RECORD = {"run_id": "r", "host": "127.0.0.1", "port": 1, "durable": True, "reattach_timeout": 600.0}
TI = TaskBinding("dag", "run", "train", -1)


@pytest.mark.parametrize("state", ["running", "deferred", "up_for_retry"])
def test_a_live_run_is_read_from_its_supervisor(state):
    facts = TaskFacts(state=state, history=reports(1), run_record=RECORD)
    asked = []
    source, history = metric_history(
        facts, lambda record, task: asked.append((record, task)) or reports(3), TI
    )
    assert (source, len(history)) == ("live", 3) and asked == [(RECORD, TI)]


def test_xcom_when_the_run_does_not_answer_or_the_task_has_ended():
    def gone(record: Any, task: TaskBinding) -> None:
        return None

    assert metric_history(TaskFacts("running", reports(2), RECORD), gone, TI) == ("xcom", reports(2))
    never = pytest.fail
    assert metric_history(TaskFacts("success", reports(5), RECORD), never, TI) == ("xcom", reports(5))
    assert metric_history(TaskFacts("running", reports(2), None), never, TI) == ("xcom", reports(2))
    assert metric_history(TaskFacts("queued", [], None), never, TI) == (None, [])


def test_live_history_of_a_record_that_is_not_ours_or_nowhere_is_none():
    from airflow_provider_torchdist.supervision.record import RunRecord
    from airflow_provider_torchdist.ui.task_facts import live_history

    assert live_history({"something": "else"}, TI) is None
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nowhere = RunRecord(run_id="r", host="127.0.0.1", port=port, durable=True, reattach_timeout=5.0)
    assert live_history(nowhere.to_dict(), TI) is None


# -- the app --------------------------------------------------------------------------------------


@dataclass
class FakeUser:
    name: str
    may_read: bool

    def get_id(self) -> str:
        return self.name

    def get_name(self) -> str:
        return self.name


class FakeAuthManager:
    """Airflow's auth manager as the security dependencies use it: a token names a user; a user may
    read DAGs or not."""

    def __init__(self) -> None:
        self.users = {"reader-token": FakeUser("reader", True), "stranger-token": FakeUser("stranger", False)}
        self.asked: list[dict[str, Any]] = []

    async def get_user_from_token(self, token: str) -> FakeUser:
        from jwt import InvalidTokenError

        if token not in self.users:
            raise InvalidTokenError("not ours")
        return self.users[token]

    def is_authorized_dag(self, *, method: str, access_entity: Any, details: Any, user: FakeUser) -> bool:
        self.asked.append(
            {"method": method, "entity": access_entity, "dag_id": details.id, "user": user.name}
        )
        return user.may_read


class FakeFacts:
    def __init__(self, facts: dict[tuple[str, str, str, int], TaskFacts]) -> None:
        self.facts = facts

    def read(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> TaskFacts | None:
        return self.facts.get((dag_id, run_id, task_id, map_index))


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> FakeAuthManager:
    from airflow.api_fastapi.core_api import security
    from airflow.models.dag import DagModel

    manager = FakeAuthManager()
    monkeypatch.setattr(security, "get_auth_manager", lambda: manager)
    # Multi-team deployments look the DAG's team up in the metadata DB; these tests have none.
    monkeypatch.setattr(DagModel, "get_team_name", staticmethod(lambda *a, **k: None), raising=False)
    return manager


@pytest.fixture
def client(auth: FakeAuthManager):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow_provider_torchdist.ui import app as ui_app
    from airflow_provider_torchdist.ui.plugin import URL_PREFIX, TrainingApp

    facts = FakeFacts(
        {
            ("train_dag", RUN_ID, "train", -1): TaskFacts("success", reports(10), None, 2),
            ("train_dag", RUN_ID, "train", 3): TaskFacts("running", reports(2), None, 4),
            ("train_dag", RUN_ID, "train", 4): TaskFacts("success", reports(10), None, 2, checkpoints=KEPT),
            ("train_dag", RUN_ID, "evaluate", -1): TaskFacts(
                "success", operator="_PythonDecoratedOperator", custom_operator_name="@task"
            ),
            ("train_dag", RUN_ID, "sweep", -1): TaskFacts(
                "queued",
                operator="TorchDistributorDecoratedOperator",
                custom_operator_name="@task.torch_distributor",
            ),
        }
    )
    plugin_app = TrainingApp()
    plugin_app.app.dependency_overrides[ui_app.task_facts_reader] = lambda: facts
    plugin_app.app.dependency_overrides[ui_app.live_history_reader] = lambda: lambda record, task: None
    server = FastAPI()  # as Airflow's API server mounts plugin apps
    server.mount(URL_PREFIX, plugin_app)
    return TestClient(server)


#: A succeeded task's XCom ``checkpoints``, best first (by val_loss).
KEPT = [
    {"uri": "s3://b/ckpt/step-000000006-0123456789ab", "step": 6, "metrics": {"val_loss": 0.1}, "time": 2.0},
    {"uri": "s3://b/ckpt/step-000000009-0123456789ab", "step": 9, "metrics": {"val_loss": 0.4}, "time": 3.0},
]


def figures_path(dag_id: str = "train_dag", run_id: str = RUN_ID, task_id: str = "train") -> str:
    return f"/torchdist/api/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}/{quote(task_id, safe='')}"


def test_without_a_token_or_cookie_it_is_401(client, auth):
    answer = client.get(figures_path())
    assert answer.status_code == 401, answer.text
    assert auth.asked == []
    assert client.get(figures_path(), headers={"Authorization": "Bearer forged"}).status_code == 403


def test_a_user_the_auth_manager_refuses_gets_403(client, auth):
    answer = client.get(figures_path(), headers={"Authorization": "Bearer stranger-token"})
    assert answer.status_code == 403, answer.text
    assert auth.asked[0] == {
        "method": "GET",
        "entity": auth.asked[0]["entity"],
        "dag_id": "train_dag",
        "user": "stranger",
    }


def test_a_reader_gets_the_figures_of_the_task_instance(client, auth):
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity

    answer = client.get(figures_path(), headers={"Authorization": "Bearer reader-token"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"training_task": True, **training_figures("success", reports(10), 2, "xcom")}
    assert answer.json()["progress"] == {"step": 9, "total_steps": 10, "fraction": 1.0, "eta_seconds": 0.0}
    # The read is checked as the REST API checks reading task instances and XComs of that DAG.
    assert {(a["method"], a["entity"], a["dag_id"]) for a in auth.asked} == {
        ("GET", DagAccessEntity.TASK_INSTANCE, "train_dag"),
        ("GET", DagAccessEntity.XCOM, "train_dag"),
    }


@pytest.mark.skipif(not has_external_views(), reason="the Training view needs Airflow 3.3+ (README)")
def test_the_ui_cookie_authenticates_too_and_map_index_picks_the_instance(client):
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN

    client.cookies.set(COOKIE_NAME_JWT_TOKEN, "reader-token")
    answer = client.get(figures_path(), params={"map_index": 3})
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "running" and answer.json()["world_size"] == 4
    assert client.get(figures_path(), params={"map_index": -2}).status_code == 422


def test_an_unknown_task_instance_is_404(client):
    headers = {"Authorization": "Bearer reader-token"}
    assert client.get(figures_path(task_id="nothing"), headers=headers).status_code == 404


def test_a_task_that_is_not_a_training_task_is_said_to_be_one_plainly(client):
    """Airflow shows the Training tab on every task (an external view cannot be limited to an
    operator): on a plain ``@task`` the view says it is not a training task, with no figures."""
    headers = {"Authorization": "Bearer reader-token"}
    answer = client.get(figures_path(task_id="evaluate"), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "training_task": False,
        "state": "success",
        "operator": "@task",
        "message": "'evaluate' is not a training task (its operator is @task): the Training tab shows the "
        "metrics of TorchDistributorOperator and @task.torch_distributor tasks only.",
    }
    sweep = client.get(figures_path(task_id="sweep"), headers=headers).json()
    assert sweep["training_task"] is True and sweep["state"] == "queued" and sweep["metrics"] == []


def test_which_task_instances_are_training_tasks():
    assert is_training_task(TaskFacts("queued", operator="TorchDistributorOperator"))
    assert is_training_task(TaskFacts("queued", operator="X", custom_operator_name="@task.torch_distributor"))
    assert not is_training_task(TaskFacts("success", operator="BashOperator"))
    # A subclass of the operator under its own name: once it has a run record or metrics.
    assert not is_training_task(TaskFacts("scheduled", operator="MyTrainer"))
    assert is_training_task(TaskFacts("running", operator="MyTrainer", run_record={"run_id": "r"}))
    assert is_training_task(TaskFacts("success", reports(1), operator="MyTrainer"))
    assert is_training_task(TaskFacts("running"))  # Airflow recorded no operator: nothing says it is not


def test_the_page_and_its_files_are_served_under_the_mount(client):
    page = client.get("/torchdist/training/train_dag/" + quote(RUN_ID, safe="") + "/train/{MAP_INDEX}")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="/torchdist/static/training.js"' in page.text and "__TORCHDIST_ROOT__" not in page.text
    assert 'data-root="/torchdist"' in page.text
    script = client.get("/torchdist/static/training.js")
    assert script.status_code == 200 and "prefers-color-scheme" in script.text
    assert client.get("/torchdist/static/training.css").status_code == 200


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to parse the script with")
def test_the_script_parses():
    from airflow_provider_torchdist.ui.app import STATIC_DIR

    done = subprocess.run(
        ["node", "--check", str(STATIC_DIR / "training.js")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# -- the plugin -----------------------------------------------------------------------------------


def test_the_view_href_uses_the_ui_placeholders_under_the_base_path():
    from airflow_provider_torchdist.ui.plugin import training_view_href

    assert training_view_href("") == "/torchdist/training/{DAG_ID}/{RUN_ID}/{TASK_ID}/{MAP_INDEX}"
    assert training_view_href("https://example.com/airflow/").startswith("/airflow/torchdist/training/")


_LOAD_PLUGINS = """
import sys
import airflow_provider_torchdist.ui.plugin
assert "fastapi" not in sys.modules, "the plugin module imported FastAPI"
from airflow import plugins_manager
apps, _ = plugins_manager.get_fastapi_plugins()
ours = [a for a in apps if a["name"] == "torchdist"]
assert ours and ours[0]["url_prefix"] == "/torchdist", "Airflow loaded no torchdist app"
info = {p["name"]: p for p in plugins_manager.get_plugin_info()}
view = info["torchdist"]["external_views"][0]
assert view["name"] == "Training" and view["destination"] == "task_instance", view
print("ok")
"""


def load_plugins(**env: str) -> subprocess.CompletedProcess[str]:
    """Airflow's plugin manager in a fresh interpreter (its caches and imports are its own)."""
    environ = {k: v for k, v in os.environ.items() if k != "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS"}
    return subprocess.run(
        [sys.executable, "-c", _LOAD_PLUGINS], env=environ | env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not has_external_views(), reason="the Training view needs Airflow 3.3+ (README)")
def test_airflow_loads_the_plugin_from_the_provider_info():
    """With provider discovery at start-up, Airflow loads the plugin from get_provider_info's
    ``plugins`` entry; importing the plugin imports no FastAPI."""
    done = load_plugins(AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS="False")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

    from airflow.plugins_manager import is_valid_plugin

    from airflow_provider_torchdist.get_provider_info import get_provider_info
    from airflow_provider_torchdist.ui.plugin import TorchdistPlugin

    (entry,) = get_provider_info()["plugins"]
    module, _, name = entry["plugin-class"].rpartition(".")
    plugin = getattr(__import__(module, fromlist=[name]), name)
    assert plugin is TorchdistPlugin and is_valid_plugin(plugin) and entry["name"] == plugin.name


@pytest.mark.skipif(not has_external_views(), reason="the Training view needs Airflow 3.3+ (README)")
def test_airflow_loads_the_plugin_by_default_through_its_entry_point():
    """With Airflow's default (providers discovered lazily) plugins come only from the
    ``airflow.plugins`` entry point, as the OpenLineage provider's does."""
    done = load_plugins()
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        "Airflow did not load the torchdist plugin by default: pyproject.toml needs "
        '[project.entry-points."airflow.plugins"] torchdist = "airflow_provider_torchdist.ui.plugin:TorchdistPlugin" '
        "(then scripts/install)\n" + done.stderr[-3000:]
    )


def test_the_plugin_registers_its_app_and_view_from_airflow_3_3_only():
    """Both CI environments run this: 3.3 (app and view) and the lowest, 3.0 (nothing)."""
    from airflow_provider_torchdist.ui.plugin import TorchdistPlugin

    assert bool(TorchdistPlugin.fastapi_apps) is bool(TorchdistPlugin.external_views) is has_external_views()


# -- whom the view asks -----------------------------------------------------------------------------


def _record(host: str, port: int = 1, run_id: str = "run-a") -> dict:
    from airflow_provider_torchdist.supervision.record import RunRecord

    return RunRecord(run_id=run_id, host=host, port=port, durable=True, reattach_timeout=60.0).to_dict()


@pytest.fixture
def asked(monkeypatch):
    """The supervisors :func:`live_history` asks (none answers), with a clean cache and a key."""
    from airflow_provider_torchdist.supervision import lifeline
    from airflow_provider_torchdist.ui import task_facts

    calls: list[tuple[str, int]] = []

    def query_status(host, port, run_id, secret, timeout):
        calls.append((host, port))
        raise lifeline.LifelineError("nobody there")

    monkeypatch.setattr(lifeline, "query_status", query_status)
    monkeypatch.setattr(task_facts, "_cache", {})
    monkeypatch.setattr(task_facts, "_view_key", lambda: b"k" * 32)
    return calls


def test_a_record_naming_another_host_is_never_asked(asked, monkeypatch):
    """Whoever can write a task's state store must not make the API server connect where they like."""
    from airflow_provider_torchdist.ui.task_facts import live_history

    assert live_history(_record("10.1.2.3", 22), TI) is None
    assert live_history(_record("169.254.169.254", 80), TI) is None
    assert asked == []
    monkeypatch.setenv("AIRFLOW__TORCHDIST__VIEW_LIFELINE_HOSTS", "10.1.2.3, worker-2")
    assert live_history(_record("10.1.2.3", 22), TI) is None
    assert asked == [("10.1.2.3", 22)]


def test_the_view_asks_with_the_credential_of_the_task_instance_it_shows(monkeypatch):
    """A record copied into another task instance's state gets that instance's credential, which
    the run's supervisor refuses: the view never shows one task's run as another's."""
    from airflow_provider_torchdist.supervision import lifeline
    from airflow_provider_torchdist.supervision.record import status_secret
    from airflow_provider_torchdist.ui import task_facts

    secrets: list[bytes] = []

    def query_status(host, port, run_id, secret, timeout):
        secrets.append(secret)
        raise lifeline.LifelineError("refused")

    monkeypatch.setattr(lifeline, "query_status", query_status)
    monkeypatch.setattr(task_facts, "_cache", {})
    monkeypatch.setattr(task_facts, "_view_key", lambda: b"k" * 32)
    other = TaskBinding("dag", "run", "train", 7)
    task_facts.live_history(_record("127.0.0.1"), TI)
    task_facts.live_history(_record("127.0.0.1"), other)  # not the first answer from the cache
    # The status credential (status queries only), never the owner's.
    assert secrets == [status_secret("run-a", b"k" * 32, TI), status_secret("run-a", b"k" * 32, other)]


def test_a_run_that_does_not_answer_is_not_asked_again_at_once(asked):
    from airflow_provider_torchdist.ui.task_facts import NOT_LIVE_CACHE_S, live_history

    now = [100.0]
    for _ in range(5):
        assert live_history(_record("127.0.0.1"), TI, clock=lambda: now[0]) is None
    assert len(asked) == 1
    now[0] += NOT_LIVE_CACHE_S + 1
    live_history(_record("127.0.0.1"), TI, clock=lambda: now[0])
    assert len(asked) == 2


def test_without_a_signing_key_the_api_server_asks_nobody_and_makes_no_key(asked, monkeypatch, tmp_path):
    from airflow_provider_torchdist.ui import task_facts

    monkeypatch.undo()  # the real _view_key: with no key it must not get as far as asking
    monkeypatch.setattr(task_facts, "_cache", {})
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", raising=False)
    monkeypatch.delenv("AIRFLOW__TORCHDIST__VIEW_STATUS_KEY", raising=False)
    assert task_facts._view_key() is None
    assert task_facts.live_history(_record("127.0.0.1"), TI) is None
    assert list(tmp_path.iterdir()) == []


def test_the_kept_checkpoints_are_marked_best_first(client):
    answer = client.get(
        figures_path(), params={"map_index": 4}, headers={"Authorization": "Bearer reader-token"}
    )
    assert answer.json()["checkpoints"] == [
        {"step": 6, "best": True, "metrics": {"val_loss": 0.1}},
        {"step": 9, "best": False, "metrics": {"val_loss": 0.4}},
    ]
    plain = client.get(figures_path(), headers={"Authorization": "Bearer reader-token"}).json()
    assert "checkpoints" not in plain  # no checkpoints kept: nothing to mark


def test_checkpoint_marks_leave_out_what_is_not_a_checkpoint_entry():
    from airflow_provider_torchdist.ui.figures import checkpoint_marks

    assert checkpoint_marks("not a list") == []
    entries = [
        "x",
        {"step": "6"},
        {"step": True},
        {"step": 3, "metrics": {"loss": float("nan"), "a": "b"}},
        {"step": 5},
    ]
    assert checkpoint_marks(entries) == [
        {"step": 3, "best": True, "metrics": {"loss": None, "a": None}},
        {"step": 5, "best": False, "metrics": {}},
    ]


def test_each_ranks_step_time_is_listed_apart_from_the_curves():
    history = [
        *reports(3),
        {"rank": 1, "time": 9.0, "summary": "step_time", "mean_step_time_s": 0.5, "compute_share": 0.9},
        {"rank": 0, "time": 9.0, "summary": "step_time", "mean_step_time_s": 0.5, "compute_share": 0.3},
        {"rank": "x", "time": 9.0, "summary": "step_time", "mean_step_time_s": 0.5},
        {"rank": 2, "time": 9.0, "summary": "step_time", "compute_share": 0.4},
    ]
    figures = training_figures("success", history, 2, "xcom")
    assert figures["metrics"] == training_figures("success", reports(3), 2, "xcom")["metrics"]  # not charted
    assert figures["ranks"] == [
        {"rank": 0, "mean_step_time_s": 0.5, "steps_per_s": 2.0, "compute_share": 0.3},
        {"rank": 1, "mean_step_time_s": 0.5, "steps_per_s": 2.0, "compute_share": 0.9},
        {"rank": 2, "mean_step_time_s": None, "steps_per_s": None, "compute_share": 0.4},
    ]
    assert "ranks" not in training_figures("success", reports(3), 2, "xcom")
    # After the run they come from XCom rank_step_times, the history holding reports only.
    apart = training_figures("success", reports(3), 2, "xcom", history[3:5])
    assert [r["rank"] for r in apart["ranks"]] == [0, 1]


def test_numbers_beyond_a_float_in_a_ranks_records_or_the_checkpoints_do_not_break_the_answer():
    """A rank sends its metric records itself (any JSON number), and the view reads them from XCom:
    an int beyond any float made ``math.isfinite`` raise, and a step time of 5e-324 made a rate of
    inf, which the JSON answer refuses; either turned the task's page into a 500."""
    huge = 10**400
    history = [
        {"rank": 0, "step": 1, "time": 1.0, "loss": huge},
        {"rank": 0, "time": 9.0, "summary": "step_time", "mean_step_time_s": huge, "compute_share": huge},
        {"rank": 1, "time": 9.0, "summary": "step_time", "mean_step_time_s": 5e-324},
    ]
    figures = training_figures("success", history, 2, "xcom")
    json.dumps(figures, allow_nan=False)  # what the JSON answer does
    assert figures["ranks"] == [
        {"rank": 0, "mean_step_time_s": None, "steps_per_s": None, "compute_share": None},
        {"rank": 1, "mean_step_time_s": 5e-324, "steps_per_s": None, "compute_share": None},
    ]
    from airflow_provider_torchdist.ui.figures import checkpoint_marks

    assert checkpoint_marks([{"step": 3, "metrics": {"loss": huge}}]) == [
        {"step": 3, "best": True, "metrics": {"loss": None}}
    ]
