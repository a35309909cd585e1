"""The slot wait says what holds the slots, as the master's web UI reports it, or that nothing does.

A real HTTP server plays the standalone master's ``/json/`` (the fields Spark's ``JsonProtocol``
writes); the wait itself runs on the fake clock and context of ``test_slots.py``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from airflow_provider_torchdist.spark.driver import master_state
from airflow_provider_torchdist.spark.driver.master_state import slot_holders
from airflow_provider_torchdist.spark.driver.slots import SlotsUnavailable, wait_for_slots
from tests.unit.spark.driver.test_slots import FakeClock, FakeContext, clock  # noqa: F401 (a fixture)

OWN_APP = "app-20260101000000-0007"


def _worker(cores: int, used: int) -> dict[str, Any]:
    return {"state": "ALIVE", "cores": cores, "coresused": used, "coresfree": cores - used}


def _app(app_id: str, name: str, cores: int) -> dict[str, Any]:
    return {"id": app_id, "name": name, "cores": cores, "state": "RUNNING"}


IDLE = {"workers": [_worker(4, 0), _worker(4, 0)], "activeapps": [_app(OWN_APP, "torchdist", 0)]}
BUSY = {
    "workers": [_worker(4, 4), _worker(4, 3)],
    "activeapps": [
        _app(OWN_APP, "torchdist", 0),
        _app("app-1", "nightly-etl", 4),
        _app("app-2", "notebook", 2),
        _app("app-3", "tiny", 1),
        _app("app-4", "idle-session", 0),
    ],
}


@pytest.fixture
def master() -> Iterator[dict[str, Any]]:
    """A master web UI whose ``/json/`` answers with the dict this fixture returns (change it)."""
    state: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps(state).encode()
            self.send_response(200 if self.path == "/json/" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _serve(master: dict[str, Any], state: dict[str, Any]) -> str:
    url = master["url"]
    master.clear()
    master.update(state)
    return url


def test_an_idle_cluster_says_nothing_else_runs(master, clock: FakeClock) -> None:  # noqa: F811
    url = _serve(master, IDLE)
    said: list[str] = []
    sc = FakeContext("spark://m:7077", {0: 0, 12: 2}, clock)  # said at 10 s
    assert wait_for_slots(sc, 2, 20, said.append, holders=functools.partial(slot_holders, url, OWN_APP)) == 2
    assert said == [
        "waiting for executors: 0 of 2 task slot(s) so far; nothing else runs on the cluster (8 cores, 8 free): "
        "this application's executors are still starting (giving up after 20s)"
    ]
    assert "other work" not in said[0]


def test_a_busy_cluster_names_the_applications_that_hold_the_cores(master, clock: FakeClock) -> None:  # noqa: F811
    url = _serve(master, BUSY)
    said: list[str] = []
    sc = FakeContext("spark://m:7077", {0: 0}, clock)
    with pytest.raises(SlotsUnavailable):
        wait_for_slots(sc, 2, 20, said.append, holders=functools.partial(slot_holders, url, OWN_APP))
    assert said[0] == (
        "waiting for executors: 0 of 2 task slot(s) so far; other applications hold 7 of the cluster's 8 "
        "cores: nightly-etl (app-1, 4 cores), notebook (app-2, 2 cores), tiny (app-3, 1 cores) (giving up after 20s)"
    )


def test_many_holders_are_counted_not_all_named(master) -> None:
    apps = [_app(f"app-{i}", f"job{i}", 1) for i in range(5)]
    url = _serve(master, {"workers": [_worker(8, 5)], "activeapps": apps})
    assert slot_holders(url, OWN_APP).endswith(
        "job0 (app-0, 1 cores), job1 (app-1, 1 cores), job2 (app-2, 1 cores) and 2 more"
    )


def test_no_alive_worker_says_so(master) -> None:
    url = _serve(master, {"workers": [{"state": "DEAD", "cores": 4}], "activeapps": []})
    assert slot_holders(url, OWN_APP).startswith("the master has no alive worker")


def test_without_the_web_ui_the_wait_says_it_cannot_tell(clock: FakeClock) -> None:  # noqa: F811
    said: list[str] = []
    sc = FakeContext("yarn", {0: 0, 12: 2}, clock)
    wait_for_slots(sc, 2, 20, said.append)
    assert said == [
        f"waiting for executors: 0 of 2 task slot(s) so far; {master_state.UNKNOWN} (giving up after 20s)"
    ]
    assert "master-web-ui" in master_state.UNKNOWN


def test_an_unreachable_web_ui_is_said_not_raised() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    text = slot_holders(f"http://127.0.0.1:{port}", OWN_APP)
    assert text.startswith(f"the master's web UI at http://127.0.0.1:{port} did not say what holds them")
