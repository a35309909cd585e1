"""Spark Connect as the engine: what is Connect's own, over a ``spark_connect`` connection to a real
Connect server (``local[2]``, on 127.0.0.1, started once per session by ``connect_server``). The core
(a callable, a script, failures, two ranks per task, Lightning) runs on both engines in
``test_training.py``.

The hook starts no spark-submit here: its child is the Connect driver, a Connect client that runs
the barrier stage as a tagged ``mapInArrow(..., barrier=True)`` job on the server's executors.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed, TrainingFailed
from tests.integration.connect_server import ConnectServer
from tests.integration.run_dags import run_in_fresh_airflow
from tests.integration.test_training import fail_on_rank_one, train_and_report

pytestmark = pytest.mark.integration


def shard_ids() -> dict | None:
    """Each rank's ``train_data`` ids, gathered to rank 0 (a train_data run's training function)."""
    import torch.distributed as dist

    from airflow_provider_torchdist import rank_shard

    dist.init_process_group("gloo")
    mine = rank_shard().column("id").to_pylist()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"shards": every} if rank == 0 else None


def ids_of(spark):
    return spark.range(0, 999, 1, 4).where("id % 2 = 0")  # 500 even ids in 4 partitions


@pytest.mark.parametrize("train_data", ["SELECT id FROM range(0, 999, 1, 4) WHERE id % 2 = 0", ids_of])
def test_train_data_over_connect_deals_each_rank_its_shard(connect_conn: str, train_data) -> None:
    """The query (or ``fn(spark)``) runs on the server's session; each node's rows come to its
    barrier task through the server's shuffle, never through this process."""
    hook = TorchDistributorHook(
        conn_id=connect_conn,
        num_processes=2,
        nproc_per_node=1,
        train_data=train_data,
        train_data_shuffle_seed=7,
    )
    shards = hook.run(shard_ids)["shards"]
    assert [len(s) for s in shards] == [250, 250]
    assert sorted(shards[0] + shards[1]) == list(range(0, 999, 2))  # every row once, none twice
    assert shards[0] != list(range(0, 500, 2))  # dealt in the seed's order, not the query's halves


def test_bad_train_data_over_connect_fails_before_any_rank_starts(connect_conn: str) -> None:
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2, train_data="db.missing_table")
    with pytest.raises(TrainingFailed, match=r"train_data failed before training: .*TABLE_OR_VIEW_NOT_FOUND"):
        hook.run(shard_ids)


def test_an_elastic_range_trains_over_connect_on_the_rendezvous_store_of_the_client(
    connect_conn: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """ "1:2" on the server's 2 slots: both nodes join the first worker group, and the history in
    ``world_sizes`` (XCom's, on the operator) says so; the store is served by the Connect client."""
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes="1:2", join_window=10)
    result = hook.run(train_and_report, 1.0)
    assert (result["rank"], result["world_size"], result["allreduce"]) == (0, 2, 1.0)
    assert [(e["world_size"], e["reason"]) for e in hook.world_sizes] == [(2, "start")]
    text = "".join(capfd.readouterr())
    assert "elastic mode over Spark Connect: 1 to 2 ranks, 2 Spark task(s) x 1 process(es)" in text
    assert "rendezvous store on 127.0.0.1:" in text


def test_a_rank_raising_in_an_elastic_run_over_connect_fails_it_with_that_error_not_a_loss(
    connect_conn: str,
) -> None:
    """Rank 1's exception stops the run; the node that Spark then stops is no loss to restart for,
    nor a reason in the verdict."""
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes="1:2", join_window=10, max_restarts=0)
    with pytest.raises(TrainingFailed) as info:
        hook.run(fail_on_rank_one)
    message = str(info.value)
    assert "ValueError: rank one refuses to train" in message
    assert "could not go on" not in message and "lost" not in message, message


def test_an_elastic_min_the_servers_local_master_cannot_fit_fails_before_any_task(connect_conn: str) -> None:
    with pytest.raises(
        TrainingFailed,
        match=r"elastic run needs at least 3 task slot\(s\) at once but the cluster has 2 .*local\[2\]",
    ):
        TorchDistributorHook(conn_id=connect_conn, num_processes="3:4").run(train_and_report, 1.0)


MODULE_PKG = Path(__file__).parent / "module_pkg" / "torchdist_modtest"


def test_module_mode_with_py_files_over_connect(connect_conn: str, tmp_path: Path) -> None:
    """``-m torchdist_modtest.train``, importable only from ``py_files`` (not installed anywhere):
    the package goes with the job and onto every rank's path."""
    out = tmp_path / "out"
    out.mkdir()
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2, py_files=[str(MODULE_PKG)])
    assert hook.run("-m torchdist_modtest.train", "--out", str(out), "--lr", "0.5") is None
    for rank in (0, 1):
        assert (out / f"rank-{rank}").read_text() == f"--out {out} --lr 0.5|2|__main__"


def use_shipped_helper() -> int:
    import torchdist_connect_helper  # only in py_files

    return torchdist_connect_helper.ANSWER


def test_a_callable_imports_a_py_files_module_over_connect(connect_conn: str, tmp_path: Path) -> None:
    helper = tmp_path / "torchdist_connect_helper.py"
    helper.write_text("ANSWER = 42\n")
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2, py_files=[str(helper)])
    assert hook.run(use_shipped_helper) == 42


def socket_interfaces() -> dict[str, str | None]:
    """The interfaces gloo and NCCL are told to use, as rank 0 sees them (no process group needed)."""
    import os

    return {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def test_interface_selection_over_connect(connect_conn: str) -> None:
    """By default the ranks use the interface that carries their executor's address (loopback for
    this server's executors); ``socket_ifname`` overrides it (a name no host has: nothing binds)."""
    chosen = TorchDistributorHook(conn_id=connect_conn, num_processes=2).run(socket_interfaces)
    assert chosen == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    told = TorchDistributorHook(conn_id=connect_conn, num_processes=2, socket_ifname="tdtest0").run(
        socket_interfaces
    )
    assert told == {"GLOO_SOCKET_IFNAME": "tdtest0", "NCCL_SOCKET_IFNAME": "tdtest0"}


def test_local_mode_over_connect_is_refused_before_anything_starts(connect_conn: str) -> None:
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2, local_mode=True)
    with pytest.raises(InvalidTrainingConfig, match="the Connect server's driver runs no user code"):
        hook.run(train_and_report, 1.0)
    assert hook.submission is None


def test_an_unreachable_connect_server_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.deployment import free_port

    port = free_port()  # nothing listens there
    monkeypatch.setenv(
        "AIRFLOW_CONN_NOWHERE", json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": port})
    )
    hook = TorchDistributorHook(conn_id="nowhere", num_processes=2)
    with pytest.raises(
        SparkSubmitFailed, match=rf"Cannot reach the Spark Connect server sc://127.0.0.1:{port}"
    ):
        hook.run(train_and_report, 1.0)
    assert hook.submission is None


def note_pids_and_sleep(marker_dir: str) -> None:
    """Each rank notes its PID and its agent's (torchrun's), then trains "forever"."""
    import os

    Path(marker_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps([os.getpid(), os.getppid()]))
    time.sleep(300)


class SleepingRun:
    """``hook.run(note_pids_and_sleep, marker_dir)`` in a thread, until every rank has noted its PID
    and its agent's (``pids``); ``raised`` holds what ``run`` raised once it ends."""

    def __init__(self, hook: TorchDistributorHook, marker_dir: Path) -> None:
        self.raised: list[BaseException] = []
        self._runner = threading.Thread(target=self._run, args=(hook, str(marker_dir)))
        self._runner.start()
        files = [marker_dir / f"rank{r}.json" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in files):
            assert self._runner.is_alive() and time.monotonic() < deadline, (
                f"the ranks never started: {self.raised}"
            )
            time.sleep(0.2)
        self.pids = [pid for f in files for pid in json.loads(f.read_text())]

    def _run(self, hook: TorchDistributorHook, marker_dir: str) -> None:
        try:
            hook.run(note_pids_and_sleep, marker_dir)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            self.raised.append(exc)

    def join(self) -> None:
        self._runner.join(60)
        assert not self._runner.is_alive()


def wait_gone(pids: list[int], since: float, within: float = 30) -> list[int]:
    """The processes of ``pids`` still alive ``within`` seconds after ``since`` (waiting for them to end)."""
    while (
        alive := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    ) and (time.monotonic() - since < within):
        time.sleep(0.2)
    return alive


def test_a_kill_mid_training_interrupts_the_job_and_leaves_nothing_on_the_executors(
    connect_conn: str, tmp_path: Path
) -> None:
    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    run = SleepingRun(hook, tmp_path)
    started = time.monotonic()
    hook.on_kill()
    run.join()
    assert run.raised and isinstance(run.raised[0], (TrainingFailed, SparkSubmitFailed))
    assert not (alive := wait_gone(run.pids, started)), f"left on the executors after the kill: {alive}"


def test_the_operators_supervised_path_runs_over_connect(connect_conn: str) -> None:
    """``start_run`` hands the plan to a detached supervisor, which runs the Connect driver."""
    from airflow_provider_torchdist.spark.wire.output_store import read_output

    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    record = hook.start_run(train_and_report, [3.0], {}, durable=False)
    result = hook.follow(record, read_output)
    assert (result["world_size"], result["allreduce"]) == (2, 1.0)
    assert torch.equal(result["tensor"], torch.tensor([0.0, 3.0, 6.0]))


def test_a_stage_the_servers_local_master_cannot_fit_fails_before_any_task(connect_conn: str) -> None:
    with pytest.raises(
        TrainingFailed, match=r"needs 3 task slot\(s\) at once but the cluster has 2 .*local\[2\]"
    ):
        TorchDistributorHook(conn_id=connect_conn, num_processes=3).run(train_and_report, 1.0)


def test_a_driver_killed_outright_leaves_nothing_training_on_the_executors(
    connect_conn: str, tmp_path: Path
) -> None:
    """SIGKILL gives the Connect driver no chance to interrupt its job: the nodes notice that its end
    of the run channel closed and stop their ranks themselves."""
    import os
    import signal

    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    run = SleepingRun(hook, tmp_path)
    assert hook.submission is not None and hook.submission.session is not None
    os.kill(hook.submission.session, signal.SIGKILL)  # the driver, no SIGTERM first
    started = time.monotonic()
    run.join()
    assert run.raised and isinstance(run.raised[0], SparkSubmitFailed)
    alive = wait_gone(run.pids, started)
    assert not alive, f"still training on the executors after the driver's SIGKILL: {alive}"


def workers_and_leak() -> list[dict]:
    """Each rank's agent (the task's Python worker) and whether an earlier run's rank_env reached it."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {"worker": os.getppid(), "leak": os.environ.get("TORCHDIST_TEST_LEAK")}
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone


def test_each_run_has_a_session_of_its_own_released_when_it_ends(
    connect_conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: runs over one connection shared one Connect session (temp views, settings, Python
    workers). Each run now opens a session of its own, named in its plan, and releases it at its
    end: the next run's ranks run in other Python workers, with nothing of the first run's settings."""
    from pyspark.sql import SparkSession

    from airflow_provider_torchdist.spark.connect.sessions import planned_session_id

    first_hook = TorchDistributorHook(
        conn_id=connect_conn, num_processes=2, rank_env={"TORCHDIST_TEST_LEAK": "first run"}
    )
    first = first_hook.run(workers_and_leak)
    second_hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2)
    second = second_hook.run(workers_and_leak)
    assert [r["leak"] for r in first] == ["first run", "first run"]
    assert [r["leak"] for r in second] == [None, None]
    assert not {r["worker"] for r in second} & {r["worker"] for r in first}  # not the first run's workers
    url = first_hook.plan.connection["url"]
    assert planned_session_id(url) != planned_session_id(second_hook.plan.connection["url"])
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")  # remote() sets it here: taken back afterwards
    gone = SparkSession.builder.remote(url).create()
    try:
        with pytest.raises(Exception, match="SESSION_CLOSED"):  # released when the run ended
            gone.conf.get("spark.master")
    finally:
        gone.client.close()


DAGS = Path(__file__).parents[2] / "dags"
#: Every example DAG that trains, each under its own key (ui_triggered_training with its defaults).
EXAMPLE_DAGS = ["example_torchdist", "retrain_pipeline", "script_training", "ui_triggered_training"]


def test_the_example_dags_train_over_connect_switched_by_the_connection_alone(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """dags/ as a user has it, with nothing changed but ``spark_default``: a ``spark_connect``
    connection to the server. Every example trains there, in one Airflow process on SQLite."""
    home = tmp_path / "home"
    connection = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_server.port}
    env = {
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(connection),
        "TORCHDIST_DATA_DIR": str(home / "data"),
        "TORCHDIST_MODELS_DIR": str(home / "models"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    states, output = run_in_fresh_airflow(home, DAGS, EXAMPLE_DAGS, env=env)
    assert {key: run["state"] for key, run in states.items()} == dict.fromkeys(EXAMPLE_DAGS, "success"), (
        output[-5000:]
    )
    # Each training task went over Connect (the Connect driver's first line), none through spark-submit.
    assert output.count("distributed mode over Spark Connect: 2 Spark task(s)") == len(EXAMPLE_DAGS), output[
        -5000:
    ]
    assert "Spark-Submit cmd" not in output
    # What the Training view shows of a finished run (its XCom history), as on the spark-submit path.
    from airflow_provider_torchdist.operators.xcom import METRICS_XCOM_KEY
    from tests.integration.test_dags import xcom

    run = states["retrain_pipeline"]
    history = xcom(home / "airflow.db", "retrain_pipeline", run["run_id"], "train", METRICS_XCOM_KEY)
    assert history and all({"rank", "step"} <= set(m) for m in history), history
    assert (home / "models" / "current.pt").exists()  # retrain_pipeline promoted its first model
    for rank in (0, 1):
        assert f"script rank {rank}/2 done: weight" in output


def test_an_elastic_dag_over_connect_pushes_the_same_world_sizes_history_to_xcom(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """The elastic test DAG (``"{{ '1:2' }}"``, a downstream task reading ``world_sizes`` from XCom),
    with ``spark_default`` pointing at the Connect server: the same history as on the spark-submit
    path (``test_dags.py::test_an_elastic_range_trains_and_its_world_sizes_reach_xcom``)."""
    from tests.integration.test_dags import DAGS as TEST_DAGS
    from tests.integration.test_dags import xcom

    home = tmp_path / "home"
    connection = {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_server.port}
    env = {"AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(connection), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    states, output = run_in_fresh_airflow(home, TEST_DAGS, ["torchdist_e2e_elastic"], env=env)
    run = states["torchdist_e2e_elastic"]
    assert run["state"] == "success", output[-5000:]
    assert xcom(home / "airflow.db", "torchdist_e2e_elastic", run["run_id"], "sizes") == [[2, "start"]]
    assert "elastic mode over Spark Connect: 1 to 2 ranks" in output


def test_a_hung_rank_over_connect_is_named_and_its_job_interrupted(
    connect_conn: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The hang watchdog on the Connect engine: rank 1 asleep in user code while rank 0 waits in
    all_reduce (tests/integration/test_hangs.py's fault), found within hang_timeout + 30 s and named;
    the job is interrupted and no rank is left on the executors."""
    from airflow_provider_torchdist.errors import TrainingHung
    from tests.integration.test_hangs import BOUND_S, HANG_TIMEOUT, SLEEP_LINE, train_with_fault

    hook = TorchDistributorHook(conn_id=connect_conn, num_processes=2, hang_timeout=HANG_TIMEOUT)
    with pytest.raises(TrainingHung) as info:
        hook.run(train_with_fault, "sleep", str(tmp_path))
    failed_at, since = time.time(), time.monotonic()
    struck = min(float(p.read_text()) for p in tmp_path.glob("fault*"))
    assert failed_at - struck < BOUND_S, f"{failed_at - struck:.0f} s from the fault to the failure"
    assert "suspect: rank 1 on " in str(
        info.value
    ) and f"test_hangs.py:{SLEEP_LINE} in train_with_fault" in str(info.value)
    assert "waits in a collective (torch.distributed all_reduce)" in "".join(capfd.readouterr())
    pids = [int(pid) for p in tmp_path.glob("pids*") for pid in p.read_text().split()]
    assert not (alive := wait_gone(pids, since)), f"left on the executors after the hang: {alive}"
