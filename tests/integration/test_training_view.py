"""The Training view on the real deployment: a deferred run (``training_view``, in
tests/integration/dags/training_view_dags.py) stops half-way at a gate; the test looks at the view
then, opens the gate, and looks again once the task has succeeded.

While gated: the JSON endpoint answers the reports so far, from the run's supervisor (a deferred
task has no process to push XCom), and headless Chromium renders the page with a partial curve per
metric, the progress text and the world size, in light and dark themes, and the task instance page
shows it in its "Training" tab. After: the whole curve, and the figures XCom holds.

The screenshots go to ``artifacts/training_view_{running,done}_{light,dark}.png`` (the page) and
``artifacts/training_tab_{running,done}_{light,dark}.png`` (the task instance page with the tab).

The shared deployment authenticates everyone as admin (``TORCHDIST_NO_LOGIN=1``: a middleware adds
a token to every request), so a request without a token is checked against Airflow's API app built
from the same AIRFLOW_HOME and metadata DB with a login required.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.dags.training_view_dags import GATE_STEP, STEPS, WORLD_SIZE, figures
from tests.integration.deployment import ROOT, ApiError, Deployment, quote, wait_for
from tests.integration.test_deployment import browse, chromium, png_size

pytestmark = pytest.mark.integration

DAG_ID = "training_view"
TASK_ID = "train"
ARTIFACTS = ROOT / "artifacts"
REPORT_TIMEOUT = 300
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def browser() -> str:
    binary = chromium()
    if binary is None:
        pytest.fail("Chromium is not installed and scripts/install-chromium could not install it")
    return binary


@pytest.fixture(scope="module")
def gated_run(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A ``training_view`` run once rank 0 has reported the steps before its gate; the gate is open,
    and the run over, when the module's tests are done."""
    plugins = deployment.call("GET", "/api/v2/plugins")["plugins"]
    if "torchdist" not in {p["name"] for p in plugins}:
        pytest.fail(
            "the API server did not load the torchdist plugin: pyproject.toml needs "
            '[project.entry-points."airflow.plugins"] torchdist = '
            '"airflow_provider_torchdist.ui.plugin:TorchdistPlugin" (then scripts/install)'
        )
    gate = tmp_path_factory.mktemp("training_view_gate")
    run_id = deployment.trigger(DAG_ID, {"gate_dir": str(gate)})
    try:
        started = time.monotonic()
        wait_for(
            lambda: (gate / "reported").exists() or _ended(deployment, run_id),
            REPORT_TIMEOUT,
            f"rank 0 of {DAG_ID} to report {GATE_STEP} steps",
        )
        if not (gate / "reported").exists():
            pytest.fail(f"the run ended before its gate:\n{deployment.run_report(DAG_ID, run_id)}")
        print(f"gated after {GATE_STEP} reports in {time.monotonic() - started:.1f} s")
        yield {"run_id": run_id, "gate": gate}
    finally:
        (gate / "release").touch()
        deployment.wait_run(DAG_ID, run_id, timeout=RUN_TIMEOUT)


def _ended(deployment: Deployment, run_id: str) -> bool:
    return deployment.dag_run(DAG_ID, run_id)["state"] in ("success", "failed")


def figures_path(run_id: str) -> str:
    return f"/torchdist/api/runs/{quote(DAG_ID)}/{quote(run_id)}/{quote(TASK_ID)}"


def expected_points(steps: int) -> list[dict[str, Any]]:
    """What rank 0 reported for steps ``0 .. steps - 1``, as the endpoint charts it (time aside)."""
    return [{"step": step, **figures(step)} for step in range(steps)]


def without_time(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in point.items() if k != "time"} for point in points]


def xcom_points(deployment: Deployment, run_id: str) -> list[dict[str, Any]] | None:
    """XCom ``metrics`` as the endpoint charts it, or None when the task has pushed none yet."""
    try:
        history = deployment.xcom(DAG_ID, run_id, TASK_ID, "metrics")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    if isinstance(history, str):  # the REST API's native form of a JSON value
        history = json.loads(history)
    return [
        {k: v for k, v in record.items() if k not in ("rank", "total_steps")}
        for record in history
        if record.get("rank") == 0
    ]


# -- what the browser renders ---------------------------------------------------------------------


def view_url(deployment: Deployment, run_id: str, theme: str) -> str:
    # {MAP_INDEX} as the UI leaves it on the page of a task that is not mapped.
    return f"{deployment.url}/torchdist/training/{quote(DAG_ID)}/{quote(run_id)}/{TASK_ID}/{{MAP_INDEX}}?theme={theme}"


def tab_url(deployment: Deployment, run_id: str) -> str:
    return f"{deployment.url}/dags/{quote(DAG_ID)}/runs/{quote(run_id)}/tasks/{TASK_ID}/plugin/torchdist-training"


def rendered(browser: str, url: str, profile: Path) -> str:
    dom = browse(browser, profile, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    return dom.stdout


def curves(dom: str) -> dict[str, int]:
    """Each chart's metric and how many points its curve has (its ``points`` attribute, checked
    against its ``data-points``)."""
    found = {}
    for tag in re.findall(r"<polyline\b[^>]*>", dom):
        name = re.search(r'data-metric="([^"]*)"', tag).group(1)
        count = int(re.search(r'data-points="(\d+)"', tag).group(1))
        coordinates = re.search(r'points="([^"]*)"', tag).group(1).split()
        assert len(coordinates) == count, tag
        found[name] = count
    return found


def check_view_dom(dom: str, theme: str, points: int, progress: str, state: str) -> None:
    assert 'data-loaded="true"' in dom, dom[-3000:]
    assert f'data-theme="{theme}"' in dom, dom[:500]
    assert f'data-state="{state}"' in dom
    assert curves(dom) == {"loss": points, "accuracy": points}
    assert re.search(r'class="metric-name">loss<', dom) and re.search(r'class="metric-name">accuracy<', dom)
    assert f'id="progress-text">{progress}<' in dom, re.search(r'id="progress-text">[^<]*<', dom)
    assert f'id="world-size">{WORLD_SIZE}<' in dom


def brightness_at(path: Path, x: int, y: int) -> float:
    """The mean of the colour channels (0 black .. 255 white) of the pixel at ``x``, ``y`` of an
    8-bit RGB(A) PNG, as Chromium writes them (no interlacing)."""
    data = path.read_bytes()
    width, _height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    channels = 3 if colour == 2 else 4
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            chunks.append(data[at + 8 : at + 8 + length])
        at += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    above = bytearray(stride)
    for row in range(y + 1):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = above[i]
            c = above[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        above = line
    return sum(above[x * channels : x * channels + 3]) / 3


def screenshot(browser: str, url: str, profile: Path, name: str, *flags: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    ARTIFACTS.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    shot = browse(browser, profile, url, *flags, f"--screenshot={path}")
    assert shot.returncode == 0 and path.exists(), shot.stderr[-3000:]
    assert png_size(path) == (1400, 900)
    return path


def check_screenshots(browser: str, deployment: Deployment, run_id: str, phase: str, tmp_path: Path) -> None:
    """The page in both themes (``?theme=``), and the task instance page with the tab in both (the
    UI follows the OS's colour scheme by default, and the view follows the UI)."""
    for theme in ("light", "dark"):
        page = screenshot(
            browser,
            view_url(deployment, run_id, theme),
            tmp_path / f"shot-{theme}",
            f"training_view_{phase}_{theme}",
        )
        flags = ("--force-dark-mode",) if theme == "dark" else ()
        tab = screenshot(
            browser,
            tab_url(deployment, run_id),
            tmp_path / f"tab-{theme}",
            f"training_tab_{phase}_{theme}",
            *flags,
        )
        # An empty spot right of the figures: the page's background, in the tab the iframe's (so the
        # page followed the UI); and the UI's navigation bar beside it.
        for path, x, y in ((page, 1300, 80), (tab, 1300, 300), (tab, 30, 600)):
            brightness = brightness_at(path, x, y)
            assert (brightness < 80) if theme == "dark" else (brightness > 170), (path, x, y, brightness)
        assert page.stat().st_size > 15_000  # charts and text, not a blank page


# -- the tests ------------------------------------------------------------------------------------


def test_the_view_follows_the_run_then_shows_the_whole_curve(
    deployment: Deployment, gated_run: dict[str, Any], browser: str, tmp_path: Path
) -> None:
    run_id = gated_run["run_id"]

    # While gated: the reports so far, from the supervisor (a deferred task pushes no XCom), or
    # from XCom where the task process pushes it live; the same figures either way.
    def reported() -> dict[str, Any] | None:
        answer = deployment.call("GET", figures_path(run_id))
        return answer if len(answer["metrics"]) >= GATE_STEP else None

    live = wait_for(reported, 60, f"the endpoint to show {GATE_STEP} reports", interval=0.5)
    assert live["state"] in ("deferred", "running"), live
    assert live["source"] in ("live", "xcom"), live
    assert without_time(live["metrics"]) == expected_points(GATE_STEP)
    assert live["world_size"] == WORLD_SIZE
    progress = live["progress"]
    assert (progress["step"], progress["total_steps"], progress["fraction"]) == (GATE_STEP - 1, STEPS, 0.5)
    assert 0 < progress["eta_seconds"] < 60, progress
    in_xcom = xcom_points(deployment, run_id)
    if in_xcom is not None:
        assert without_time(in_xcom) == expected_points(len(in_xcom))
    print(f"mid-run figures from {live['source']}; XCom holds {None if in_xcom is None else len(in_xcom)}")

    running = "4 / 8 steps (50%)"
    for theme in ("light", "dark"):
        dom = rendered(browser, view_url(deployment, run_id, theme), tmp_path / f"dom-{theme}")
        check_view_dom(dom, theme, GATE_STEP, running, live["state"])
    tab = rendered(browser, tab_url(deployment, run_id), tmp_path / "dom-tab")
    assert re.search(r'<iframe[^>]*src="/torchdist/training/training_view/[^"]*/train/', tab), tab[-3000:]
    check_screenshots(browser, deployment, run_id, "running", tmp_path)

    # Open the gate: the task succeeds, and XCom holds the whole history.
    (gated_run["gate"] / "release").touch()
    final_run = deployment.wait_run(DAG_ID, run_id, timeout=RUN_TIMEOUT)
    assert final_run["state"] == "success", deployment.run_report(DAG_ID, run_id)
    done = deployment.call("GET", figures_path(run_id))
    assert done["state"] == "success" and done["source"] == "xcom", done
    assert without_time(done["metrics"]) == expected_points(STEPS)
    assert done["metrics"] == xcom_points(deployment, run_id)
    assert done["progress"] == {"step": STEPS - 1, "total_steps": STEPS, "fraction": 1.0, "eta_seconds": 0.0}
    assert done["world_size"] == WORLD_SIZE
    # Each rank's step time, which the run adds at its end (the hang watchdog's): XCom rank_step_times.
    assert deployment.xcom(DAG_ID, run_id, TASK_ID, "rank_step_times") is not None
    assert [r["rank"] for r in done["ranks"]] == list(range(WORLD_SIZE)), done.get("ranks")
    ranks = done["ranks"]
    assert ranks[0]["mean_step_time_s"] > 0, ranks  # rank 0 reports each step; the others only sleep
    assert all(0 <= r["compute_share"] <= 1 for r in ranks), ranks

    for theme in ("light", "dark"):
        dom = rendered(browser, view_url(deployment, run_id, theme), tmp_path / f"dom-done-{theme}")
        check_view_dom(dom, theme, STEPS, "8 / 8 steps (100%)", "success")
        assert 'id="eta-text">done<' in dom
        assert len(re.findall(r'<tr data-rank="\d+">', dom)) == WORLD_SIZE, dom[-3000:]
    check_screenshots(browser, deployment, run_id, "done", tmp_path)


_REAL_APP = """
import json, sys
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app

path, token = sys.argv[1], sys.argv[2]
client = TestClient(create_app(apps="core"))
answers = {
    "core_without_token": client.get("/api/v2/dags").status_code,
    "without_token": client.get(path).status_code,
    "bad_token": client.get(path, headers={"Authorization": "Bearer not-a-token"}).status_code,
}
good = client.get(path, headers={"Authorization": "Bearer " + token})
answers["with_token"] = good.status_code
answers["body"] = good.json() if good.status_code == 200 else good.text
print("ANSWERS " + json.dumps(answers))
"""


def test_the_endpoint_requires_the_api_servers_authentication(
    deployment: Deployment, gated_run: dict[str, Any]
) -> None:
    path = figures_path(gated_run["run_id"])
    # The shared deployment: a bad token is refused as by the REST API (its all-admins middleware
    # authenticates requests that carry none).
    for where in (path, "/api/v2/dags"):
        with pytest.raises(ApiError) as refused:
            deployment.call("GET", where, token="not-a-token")
        assert refused.value.status == 403, where

    # Airflow's API app on the same home and metadata DB, with a login required: 401 without a
    # token, as /api/v2; the deployment's token (same JWT secret) reads the same figures.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env |= {
        "AIRFLOW_HOME": str(deployment.home),
        "AIRFLOW__CORE__AUTH_MANAGER": (
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__API__BASE_URL": deployment.url,
    }
    env |= deployment.settings  # its metadata DB
    deployment.login()
    done = subprocess.run(
        [sys.executable, "-c", _REAL_APP, path, deployment.token],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("ANSWERS ")), None)
    assert done.returncode == 0 and line, (done.stdout[-2000:], done.stderr[-3000:])
    answers = json.loads(line.removeprefix("ANSWERS "))
    assert answers["core_without_token"] == 401
    assert answers["without_token"] == 401
    assert answers["bad_token"] == 403
    assert answers["with_token"] == 200, answers["body"]
    served = deployment.call("GET", path)
    assert without_time(answers["body"]["metrics"]) == without_time(served["metrics"])
    assert answers["body"]["world_size"] == WORLD_SIZE


@pytest.mark.parametrize("dag_id", ["callbacks_transformers", "callbacks_lightning"])
def test_a_framework_callbacks_loss_shows_in_the_view(
    dag_id: str, deployment: Deployment, browser: str, tmp_path: Path
) -> None:
    """A Hugging Face / Lightning Trainer across 2 Spark tasks, reporting only through the provider's
    callback (tests/integration/dags/callbacks_training.py): the view charts its loss with progress."""
    run_id = deployment.trigger(dag_id)
    run = deployment.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)
    assert run["state"] == "success", deployment.run_report(dag_id, run_id)

    answer = deployment.call("GET", f"/torchdist/api/runs/{quote(dag_id)}/{quote(run_id)}/{TASK_ID}")
    losses = [point for point in answer["metrics"] if point.get("loss") is not None]
    assert len(losses) >= 2, answer
    assert answer["progress"]["total_steps"] and answer["progress"]["fraction"] == 1.0, answer["progress"]
    assert answer["world_size"] == 2

    url = f"{deployment.url}/torchdist/training/{quote(dag_id)}/{quote(run_id)}/{TASK_ID}/{{MAP_INDEX}}?theme=light"
    dom = rendered(browser, url, tmp_path / "profile")
    assert 'data-loaded="true"' in dom and 'data-state="success"' in dom, dom[-3000:]
    assert curves(dom)["loss"] == sum(1 for point in answer["metrics"] if point.get("loss") is not None)
    total = answer["progress"]["total_steps"]
    # The framework's checkpoint callback kept the newest 2 (the best first): each marked on each curve.
    steps = {"callbacks_transformers": [16, 8], "callbacks_lightning": [24, 16]}[dag_id]
    assert [mark["step"] for mark in answer["checkpoints"]] == steps, answer.get("checkpoints")
    assert [mark["best"] for mark in answer["checkpoints"]] == [True, False]
    marked = re.findall(r'<line class="checkpoint( best)?"[^>]*data-step="(\d+)"', dom)
    assert sorted({(bool(best), int(step)) for best, step in marked}) == [(False, steps[1]), (True, steps[0])]
    assert f'id="progress-text">{total} / {total} steps (100%)<' in dom, re.search(
        r'id="progress-text">[^<]*<', dom
    )
