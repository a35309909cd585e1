"""What holds a cluster's task slots while a run waits for them, as the master reports it.

The driver knows only how many slots its own executors offer. Who holds the others is the
master's to say: a standalone master's web UI (the connection's extra ``master-web-ui``, passed on
in the job spec) lists its workers' cores and the applications that were granted them. With it, the
wait names the other applications, or says that nothing else runs and the executors are still
starting; without it, the wait says it cannot tell which. Standard library only: it runs in the
Spark driver.

Example::

    slot_holders("http://master:8080", "app-20240101-0001")
    # 'nothing else runs on the cluster (8 cores, 8 free): this application's executors are still starting'
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

#: Seconds to wait for the master's web UI: the wait's message is not worth more.
STATE_TIMEOUT_S = 3.0
#: How many other applications a message names.
NAMED_APPS = 3

UNKNOWN = (
    "this application's executors are still starting, or other work holds the cluster's cores "
    "(give the Spark connection the master's web UI, extra master-web-ui, to say which)"
)


def master_state(master_web_ui: str, timeout: float = STATE_TIMEOUT_S) -> dict[str, Any]:
    """The standalone master's ``/json/`` state (workers, active applications)."""
    url = master_web_ui.rstrip("/") + "/json/"
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the user's own master
        return json.loads(response.read())


def describe_holders(state: dict[str, Any], own_app_id: str | None) -> str:
    """Who holds the cluster's cores in ``state``, apart from the application ``own_app_id``."""
    workers = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
    cores = sum(int(w.get("cores", 0)) for w in workers)
    free = sum(int(w.get("coresfree", int(w.get("cores", 0)) - int(w.get("coresused", 0)))) for w in workers)
    others = [
        a
        for a in state.get("activeapps", [])
        if a.get("id") != own_app_id and a.get("state", "RUNNING") in ("RUNNING", "WAITING")
    ]
    holding = [a for a in others if int(a.get("cores", 0)) > 0]
    if not workers:
        return "the master has no alive worker: start one, or check that the workers reach the master"
    if holding:
        holding.sort(key=lambda a: -int(a["cores"]))  # the largest holders first
        named = [f"{a.get('name', '?')} ({a.get('id', '?')}, {int(a['cores'])} cores)" for a in holding]
        more = "" if len(named) <= NAMED_APPS else f" and {len(named) - NAMED_APPS} more"
        held = sum(int(a["cores"]) for a in holding)
        return f"other applications hold {held} of the cluster's {cores} cores: {', '.join(named[:NAMED_APPS])}{more}"
    return (
        f"nothing else runs on the cluster ({cores} cores, {free} free): this application's executors "
        "are still starting"
    )


def slot_holders(master_web_ui: str | None, own_app_id: str | None) -> str:
    """What holds the slots a run waits for, or why that is unknown; never raises."""
    if not master_web_ui:
        return UNKNOWN
    try:
        return describe_holders(master_state(master_web_ui), own_app_id)
    except (OSError, ValueError) as exc:
        return f"the master's web UI at {master_web_ui} did not say what holds them ({type(exc).__name__}: {exc})"
