"""Multi-host: a Spark standalone cluster whose two workers are test hosts in their own network
namespaces, each with its own address. The ranks must rendezvous across those real addresses."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import InvalidTrainingConfig, TrainingFailed
from tests.cluster import ClusterInfo, leftover_network, start_cluster, stop_cluster, wait_idle
from tests.integration.connect_server import connect_on_cluster

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]

SUBNET = "10.231.88"
DRIVER_HOST = f"{SUBNET}.1"
FAKE_GPUS = Path(__file__).parent / "fixtures" / "fake_gpus.sh"


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterInfo]:
    """Master + 2 workers (2 cores, 2 fake GPUs each), every worker in its own namespace."""
    if os.geteuid() != 0:
        pytest.fail("the multi-host tests need root to create network namespaces")
    info = start_cluster(
        workers=2,
        cores=2,
        memory="1g",
        netns=True,
        prefix="tdmh",
        subnet=SUBNET,
        worker_conf={
            "spark.worker.resource.gpu.amount": "2",
            "spark.worker.resource.gpu.discoveryScript": str(FAKE_GPUS),
        },
    )
    try:
        yield info
    finally:
        stop_cluster(info)
    assert not leftover_network("tdmh")


@pytest.fixture(autouse=True)
def _idle_cluster(cluster: ClusterInfo) -> None:
    """Each test starts on an idle cluster: the earlier test's applications have let go of every core
    (a run whose connection names the web UI would wait for a held slot as long as it takes)."""
    wait_idle(cluster)


def connect(
    monkeypatch: pytest.MonkeyPatch, info: ClusterInfo, web_ui: bool = True, shared_dir: Path | None = None
) -> str:
    """A ``spark`` connection to the cluster, the usual Airflow way (an AIRFLOW_CONN_ variable)."""
    extra: dict[str, str] = {"master-web-ui": info.master_ui_url} if web_ui else {}
    if shared_dir is not None:  # the test hosts share this machine's filesystem
        extra["shared-dir"] = str(shared_dir)
    conn = {
        "conn_type": "spark",
        "host": f"spark://{info.master_host}",
        "port": info.master_port,
        "extra": extra,
    }
    conn_id = "spark_cluster" if web_ui else "spark_cluster_plain"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


def cluster_hook(monkeypatch: pytest.MonkeyPatch, info: ClusterInfo, **kwargs) -> TorchDistributorHook:
    conf = {
        # The driver stays in the root namespace, reachable from the workers on the bridge only.
        "spark.driver.host": DRIVER_HOST,
        "spark.driver.bindAddress": DRIVER_HOST,
        "spark.executor.memory": "512m",
        # Executors that start a little faster; tests only.
        "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        **kwargs.pop("conf", {}),
    }
    return TorchDistributorHook(
        conn_id=connect(monkeypatch, info, kwargs.pop("web_ui", True), kwargs.pop("shared_dir", None)),
        conf=conf,
        env_vars={"SPARK_LOCAL_IP": DRIVER_HOST},
        **kwargs,
    )


def where_ranks_ran() -> list[dict]:
    """Every rank's view, gathered to rank 0 over gloo: its address, interface and local rank."""
    import socket

    import torch.distributed as dist

    from airflow_provider_torchdist.spark.node.network import interface_address

    dist.init_process_group("gloo")
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    me = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world_size": dist.get_world_size(),
        "address": interface_address(ifname),
        "ifname": ifname,
        "master_addr": os.environ["MASTER_ADDR"],
        "hostname": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    print(f"rank {me['rank']} at {me['address']} via {ifname}")
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    dist.destroy_process_group()
    return everyone


def test_ranks_rendezvous_across_two_test_hosts(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    ranks = cluster_hook(monkeypatch, cluster, num_processes=2).run(where_ranks_ran)

    addresses = [r["address"] for r in ranks]
    assert sorted(addresses) == sorted(cluster.worker_hosts)  # two distinct test hosts
    assert all(r["ifname"] != "lo" for r in ranks)  # gloo chose the interface carrying the address
    assert ranks[0]["master_addr"] == ranks[0]["address"]  # task 0's routable address, not localhost
    text = "".join(capfd.readouterr())
    for rank, address in enumerate(addresses):
        assert f"[rank {rank} @ {address}] rank {rank} at {address}" in text  # live logs from both hosts


def test_two_by_two_topology(cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = cluster_hook(monkeypatch, cluster, num_processes=4, nproc_per_node=2).run(where_ranks_ran)

    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["world_size"] for r in ranks} == {4}
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(r["address"], []).append(r["local_rank"])
    assert sorted(by_host) == sorted(cluster.worker_hosts)  # one 2-rank task per host
    assert all(sorted(local) == [0, 1] for local in by_host.values())


def test_spark_assigned_gpus_become_cuda_visible_devices(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = cluster_hook(
        monkeypatch,
        cluster,
        num_processes=4,
        nproc_per_node=2,
        use_gpu=True,
        conf={"spark.executor.resource.gpu.amount": "2", "spark.executor.cores": "2"},
    )
    ranks = hook.run(where_ranks_ran)

    for r in ranks:
        assert sorted(r["cuda_visible_devices"].split(",")) == ["0", "1"]  # the task's two fake GPUs
    assert sorted({r["address"] for r in ranks}) == sorted(cluster.worker_hosts)


def test_job_too_big_for_the_cluster_fails_fast(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the master's web UI known, the hook refuses before spark-submit.
    started = time.monotonic()
    hook = cluster_hook(monkeypatch, cluster, num_processes=6)
    with pytest.raises(InvalidTrainingConfig, match=r"needs 6 task slot\(s\).*never offer more than 4"):
        hook.run(where_ranks_ran)
    assert hook.submission is None
    assert time.monotonic() - started < 5

    # Without it, the driver sees too few executor slots and fails after its settle period (20 s of
    # waiting for executors, by its own clock: the JVM's start before it is the machine's load), not
    # after Spark's 10 min.
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"needs 6 task slot\(s\) at once but the cluster has 4") as info:
        cluster_hook(monkeypatch, cluster, num_processes=6, web_ui=False).run(where_ranks_ran)
    waited = re.search(r"waited (\d+)s for executors", str(info.value))
    assert waited and int(waited[1]) <= 30, str(info.value)
    assert time.monotonic() - started < 300


def tag(value: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    dist.destroy_process_group()
    return {"value": value, "seen": seen, "run_id": os.environ["TORCHDIST_RUN_ID"]}


def test_three_concurrent_runs_each_get_their_own_result(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = cluster_hook(monkeypatch, cluster, num_processes=2).run(tag, name)
        except Exception as exc:  # collected and asserted below, in the test's thread
            results[name] = exc

    threads = [threading.Thread(target=run, args=(f"run-{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)

    for name in ("run-0", "run-1", "run-2"):
        result = results[name]
        assert isinstance(result, dict), f"{name}: {result!r}"
        assert result["value"] == name and result["seen"] == [name, name]
    assert len({r["run_id"] for r in results.values()}) == 3


def count_my_rows() -> list[dict]:
    """Every rank's shard through ``rank_batches``: how many ids, their sum, whether unique; and
    where the rank ran and how much anonymous memory it held."""
    import numpy as np
    import torch.distributed as dist

    from airflow_provider_torchdist import rank_batches
    from airflow_provider_torchdist.spark.node.network import interface_address

    dist.init_process_group("gloo")
    ids = np.concatenate([b["id"].numpy() for b in rank_batches(1 << 20, columns=["id"])])
    features = sum(float(b["f0"].sum()) for b in rank_batches(1 << 20, columns=["f0"]))
    rss_anon = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
    me = {
        "address": interface_address(os.environ["GLOO_SOCKET_IFNAME"]),
        "rows": int(ids.size),
        "id_sum": int(ids.sum()),
        "unique": int(np.unique(ids).size),
        "f0_sum": features,
        "rss_anon_kb": rss_anon,
        "data_dir": os.environ["TORCHDIST_DATA_DIR"],
    }
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return everyone


@pytest.mark.parametrize("route", ["shuffle", "shared-dir"])
def test_train_data_reaches_ranks_on_two_hosts_without_passing_through_the_driver(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, route: str
) -> None:
    """A Parquet data set of about 120 MB as Arrow, a driver that may collect at most 1 MB (any
    partition's rows through the driver would fail the job): every row reaches exactly one rank, on
    two hosts, the shards equal. By Spark's shuffle, or (the connection's ``shared-dir``) as files in
    a directory every host mounts, removed after the run."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, files = 3_000_000, 6
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    per_file = rows // files
    for i in range(files):
        ids = np.arange(i * per_file, (i + 1) * per_file, dtype=np.int64)
        columns = {"id": ids, **{f"f{j}": rng.random(per_file, dtype=np.float32) for j in range(8)}}
        pq.write_table(pa.table(columns), data / f"part-{i}.parquet", compression="none")
    assert rows * (8 + 8 * 4) // files > 2**20 * 10  # each partition far over maxResultSize

    shared = tmp_path / "shared"
    shared.mkdir()
    hook = cluster_hook(
        monkeypatch,
        cluster,
        shared_dir=shared if route == "shared-dir" else None,
        num_processes=2,
        train_data=f"SELECT * FROM parquet.`{data}` WHERE id % 3 != 1",
        spark_submit_kwargs={"driver_memory": "512m"},
        conf={"spark.driver.maxResultSize": "1m"},  # a collect of the rows would fail the job
    )
    ranks = hook.run(count_my_rows)

    kept = np.arange(rows, dtype=np.int64)
    kept = kept[kept % 3 != 1]
    assert sorted(r["address"] for r in ranks) == sorted(cluster.worker_hosts)
    assert [r["rows"] for r in ranks] == [kept.size // 2] * 2
    assert all(r["unique"] == r["rows"] for r in ranks)
    # Together: every kept id once (the total and sum of the ids match, and no id repeats on a rank).
    assert sum(r["id_sum"] for r in ranks) == int(kept.sum())
    if route == "shared-dir":
        (data_dir,) = {r["data_dir"] for r in ranks}
        assert Path(data_dir).parent == shared and Path(data_dir).name.startswith("torchdist-rows-")
    else:
        assert not any(r["data_dir"].startswith(str(shared)) for r in ranks)
    assert list(shared.iterdir()) == []  # the run's directory went with the run
    print("RssAnon per rank (MB):", [round(r["rss_anon_kb"] / 1024) for r in ranks])


def test_over_spark_connect_ranks_on_two_test_hosts_rendezvous_map_their_tasks_gpus_and_get_train_data(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The hook is only the Connect server's client, over 127.0.0.1, and the server's settings give
    each task its resources; a ``train_data`` query's rows reach the ranks on both hosts through
    the server's shuffle. Three runs on one server (a server holds the cluster's executors for as
    long as it is up, so the runs share it rather than start one each)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 300_000
    data = tmp_path / "data"
    data.mkdir()
    for i, ids in enumerate(np.array_split(np.arange(rows, dtype=np.int64), 3)):
        columns = {"id": ids, "f0": np.ones(ids.size, dtype=np.float32)}
        pq.write_table(pa.table(columns), data / f"part-{i}.parquet")

    gpus = {
        "spark.executor.resource.gpu.amount": "2",
        "spark.task.resource.gpu.amount": "2",
        "spark.executor.cores": "2",
        "spark.task.cpus": "2",
    }
    with connect_on_cluster(cluster, monkeypatch, gpus) as conn_id:
        ranks = TorchDistributorHook(conn_id=conn_id, num_processes=2).run(where_ranks_ran)
        addresses = [r["address"] for r in ranks]
        assert sorted(addresses) == sorted(cluster.worker_hosts)  # two distinct test hosts
        text = "".join(capfd.readouterr())
        assert "distributed mode over Spark Connect" in text
        for rank, address in enumerate(addresses):
            assert f"[rank {rank} @ {address}] rank {rank} at {address}" in text  # the channel on the bridge

        hook = TorchDistributorHook(conn_id=conn_id, num_processes=4, nproc_per_node=2, use_gpu=True)
        ranks = hook.run(where_ranks_ran)

        query = f"SELECT * FROM parquet.`{data}` WHERE id % 3 != 1"
        shards = TorchDistributorHook(conn_id=conn_id, num_processes=2, train_data=query).run(count_my_rows)
    for r in ranks:
        assert sorted(r["cuda_visible_devices"].split(",")) == ["0", "1"]  # the task's two fake GPUs
    assert sorted({r["address"] for r in ranks}) == sorted(cluster.worker_hosts)

    kept = np.arange(rows, dtype=np.int64)
    kept = kept[kept % 3 != 1]
    assert sorted(r["address"] for r in shards) == sorted(cluster.worker_hosts)
    assert [r["rows"] for r in shards] == [kept.size // 2] * 2 and all(
        r["unique"] == r["rows"] for r in shards
    )
    assert sum(r["id_sum"] for r in shards) == int(kept.sum())  # every kept id once
