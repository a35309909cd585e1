"""Shared set-up for the integration tests: an isolated Airflow home, leftover-process checks, and
the real Airflow deployment the DAG-level tests share (``deployment``; see ``deployment.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.integration import worker_timeline
from tests.integration.connect_server import (  # noqa: F401 (one Connect server per session)
    connect_conn,
    connect_server,
)
from tests.integration.deployment import Deployment, dag_folder, running_deployment
from tests.integration.postgres import PostgresServer, start_postgres, stop_postgres
from tests.integration.run_processes import (  # noqa: F401 (a fixture for the modules that start supervisors)
    mark_this_worker,
    no_supervisor_left,
    of_this_worker,
)
from tests.object_store import s3_server  # noqa: F401 (moto's S3 server, one per session)

pytestmark = pytest.mark.integration


def pytest_configure(config: pytest.Config) -> None:
    # Before xdist starts its workers (they inherit the controller's mark) and before any test starts
    # a process: the process checks below keep to processes with this worker's mark.
    mark_this_worker()


#: Session fixtures that cost a JVM or a whole Airflow each ...
_SHARED_SET_UPS = {"deployment", "connect_server"}
#: ... and the test files that use them: they run one after another in one xdist worker, so that
#: the session starts one of each (the scheduler below; a test file's tests always stay together).
SHARED_SET_UP_FILES = {
    "test_airflow_features.py",
    "test_assets.py",
    "test_chaos.py",
    "test_connect.py",
    "test_connect_lifetime.py",
    "test_connect_reattach.py",
    "test_connect_server.py",
    "test_connect_thin.py",
    "test_deployment.py",
    "test_deployment_postgres.py",
    "test_run_lifetime.py",
    "test_training_view.py",
}


#: The longest units of work first, so that no worker starts a long file when the others are nearly
#: done (xdist's own order is by number of tests); a file not listed goes last. Minutes from CI's
#: worker timeline (worker_timeline.py) on a 2-core machine. With them, the order before had one
#: worker end 3 min after the others (43.2 min, played back); this order, 41.5 min.
LONGEST_FIRST = [
    "shared",  # 40 min: the deployment's and the Connect server's files, the chaos soak among them
    "test_worker_loss.py",  # 19
    "test_install.py",  # 8.5
    "test_multihost.py",  # 7
    "test_dags.py",  # 7: 14 DAG runs in one Airflow process
    "test_lowest_versions.py",  # 6.5
    "test_training.py",  # 6
    "test_train_data.py",  # 5.5
    "test_exact_resume.py",  # 3
    "test_hangs.py",  # 3
    "test_example_dags.py",  # 2.5
    "test_mlflow_tracking.py",  # 2.5
    "test_spark_cluster.py",  # 2
    "test_readme.py",  # 2
    "test_airflow_in_process.py",  # 1.5
    "test_callbacks.py",  # 1.5
    "test_checkpoint_store.py",  # 1.5
    "test_faults.py",  # 1.5
    "test_first_dag.py",  # 1
]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker_timeline.record(report, scope_of(report.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    worker_timeline.summary(terminalreporter)


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or ``shared`` for the shared set-ups' files."""
    path = nodeid.split("::", 1)[0]
    return "shared" if path.rpartition("/")[2] in SHARED_SET_UP_FILES else path


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling (a scope's tests all run in one worker, in order) with
    :func:`scope_of` for the scopes: xdist's own ``loadgroup`` marks no longer reach pytest 9's node
    ids, and a file's module fixtures must be set up once."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetUpScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # keep the order of pytest_collection_modifyitems below
    return SharedSetUpScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every file that uses a shared set-up is listed in SHARED_SET_UP_FILES (else it would start a
    second deployment or Connect server in the other worker)."""
    using = {item.path.name for item in items if _SHARED_SET_UPS & set(item.fixturenames)}
    if missing := sorted(using - SHARED_SET_UP_FILES):
        raise pytest.UsageError(f"add {missing} to SHARED_SET_UP_FILES in {__file__}")
    # Longest units first (a stable sort: a file's tests keep their order).
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(scope_of(item.nodeid).rpartition("/")[2], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def isolated_airflow_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Keep the tests away from the user's ~/airflow and from any configured Spark connection."""
    home = str(tmp_path_factory.mktemp("airflow_home"))
    os.environ["AIRFLOW_HOME"] = home
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)
    return home


_RUN_PROCESS = ("pyspark", "torchdist", "org.apache.spark.deploy.SparkSubmit", "CoarseGrainedExecutorBackend")
#: A test cluster's own daemons (a test may start a lost Worker again): not part of any run.
_CLUSTER_DAEMON = ("org.apache.spark.deploy.worker.Worker", "org.apache.spark.deploy.master.Master")


def _run_processes() -> dict[int, str]:
    """Every live process of this pytest worker that belongs to a training run (any session, any parent)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(daemon in cmd for daemon in _CLUSTER_DAEMON):
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in cmd for marker in _RUN_PROCESS):
            if of_this_worker(proc):
                found[proc.info["pid"]] = cmd
    return found


@pytest.fixture
def no_leftovers():
    """Fail the test if a process it started (spark-submit, driver, Python workers, executors, agents,
    ranks) outlives it, whether still our child or orphaned to init."""
    before = set(_run_processes())
    yield
    deadline = time.monotonic() + 15
    while True:
        # New run processes that are still ours, or orphans (a process someone else started on the
        # machine meanwhile is neither).
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        left = {
            pid: cmd
            for pid, cmd in _run_processes().items()
            if pid not in before and (pid in ours or _parent(pid) == 1)
        }
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left running: {[(pid, cmd[:200]) for pid, cmd in left.items()]}"


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


@pytest.fixture(scope="session")
def deployment_postgres() -> Iterator[PostgresServer]:
    """The shared deployment's metadata DB: a PostgreSQL server of the session's own."""
    server = start_postgres()
    try:
        yield server
    finally:
        stop_postgres(server)


@pytest.fixture(scope="session")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, deployment_postgres: PostgresServer
) -> Iterator[Deployment]:
    """One real Airflow deployment for the whole session (``scripts/airflow-standalone`` in a temp
    AIRFLOW_HOME), serving dags/ and tests/integration/dags/; stopped, with nothing left, at the end.

    Its metadata DB is PostgreSQL, as in production: SQLite's one writer at a time made a REST call
    fail (HTTP 500, "database is locked" after its 5 s wait) while the scheduler wrote on a loaded
    machine. The README's one-command deployment on SQLite is test_readme's.

    Tests share it: each triggers runs of its own DAGs and leaves no run going.
    """
    home = tmp_path_factory.mktemp("airflow_standalone_home")
    dags = dag_folder(tmp_path_factory.mktemp("airflow_standalone_dags"))
    settings = {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": deployment_postgres.url("postgresql+psycopg2"),
        # Its DAG files do not change during a session: parsed once, not again every 30 s (measured:
        # the DAG processor's re-parses took a sixth of a core for the whole run).
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
    }
    with running_deployment(home, dags, settings) as running:
        yield running


@pytest.fixture(autouse=True)
def _deployment_test_ends_its_runs(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test on the shared deployment leaves no run going, even when it failed half-way: its
    unfinished runs are marked failed (their tasks stop their training runs), and then
    ``no_supervisor_left`` checks that no run supervisor of the test's is left. Without this, a run
    left by a failed test retries into the next test and fails it too."""
    if "deployment" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("no_supervisor_left")  # set up first, so it checks after the runs end
    shared: Deployment = request.getfixturevalue("deployment")
    since = len(shared.triggered)
    yield
    shared.fail_unfinished(since)
