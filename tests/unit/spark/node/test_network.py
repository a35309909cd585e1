"""The rendezvous store listens only where the nodes reach it, never on every interface.

Real torchrun agents (``launch_node``) run a trivial function; a rank looks at every listening TCP
socket of this process tree while the agent's store and the ranks' process group are up.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest

from airflow_provider_torchdist.spark.node import rendezvous
from airflow_provider_torchdist.spark.node.network import free_port, interface_address, listen_on
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

psutil = pytest.importorskip("psutil")

WILDCARDS = {"0.0.0.0", "::"}
NO_DRIVER = ("127.0.0.1", 1)  # the ranks run without a driver to talk to


def listeners(root_pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``root_pid`` and its descendants."""
    root = psutil.Process(root_pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections("tcp")
        except psutil.Error:
            continue
        found += [(proc.pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def report_sockets(out_dir: str, root_pid: str) -> None:
    """A rank: join the process group as training code would, then record what listens, and where."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # every rank's store client and gloo pairs are up
    rank = dist.get_rank()
    record = {
        "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
        "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
        "listeners": listeners(int(root_pid)),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()  # nobody leaves before every rank has looked
    dist.destroy_process_group()


def fail_once(out_dir: str) -> None:
    """A rank: rank 1 dies after the group formed the first time; the restarted group must form."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0 and dist.get_rank() == 1:
        os._exit(3)
    if restart == 1:
        dist.barrier()
        Path(out_dir, f"done{dist.get_rank()}").touch()
    dist.destroy_process_group()


def _script(tmp_path: Path, fn) -> str:
    """A training script that calls ``fn`` of this module with its command-line arguments.

    A script, not a callable: rank 0 of a callable sends its value to the driver, absent here.
    """
    path = tmp_path / "train.py"
    path.write_text(f"import sys\nfrom {__name__} import {fn.__name__}\n{fn.__name__}(*sys.argv[1:])\n")
    return str(path)


def _spec(**fields) -> JobSpec:
    base = dict(kind="script", entry="train.py", run_id="run-1", token="t", rendezvous_timeout=60)
    return JobSpec(**{**base, **fields})


def _node(spec: JobSpec, node_rank: int, entry: str, host: str, master):
    from airflow_provider_torchdist.spark.node.launcher import launch_node

    failures = launch_node(
        spec,
        node_rank=node_rank,
        entry_path=entry,
        channel_address=NO_DRIVER,
        host=host,
        master=master,
        node_key=bytes(32),
    )
    # With no driver, rank 0 of a script has nowhere to hand its (None) output: that one failure is
    # the harness's, not the network's, and only that one is dropped.
    return [f for f in failures if not (f.rank == 0 and "could not send its return value" in f.message)]


def _records(out: Path, n: int) -> list[dict]:
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    assert len(records) == n
    return records


def _this_machines_address() -> str:
    """An address of this machine other nodes could use (the first non-loopback one), else loopback."""
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address and not address.startswith("127."):
            return address
    return "127.0.0.1"


def test_local_mode_store_listens_on_loopback_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    entry = _script(tmp_path, report_sockets)
    spec = _spec(num_processes=2, local_mode=True, script_args=[str(out), str(os.getpid())])

    failures = _node(spec, 0, entry, "127.0.0.1", None)

    assert failures == []
    records = _records(out, 2)
    master_addr, master_port = records[0]["master"]
    assert master_addr == "127.0.0.1"
    # The ranks connect to the agent's store as clients: no store server of their own.
    assert records[0]["agent_store"] == "True"
    for record in records:
        sockets = record["listeners"]
        assert {ip for _, ip, port in sockets if port == master_port} == {"127.0.0.1"}, sockets
        assert not [s for s in sockets if s[1] in WILDCARDS], sockets


def test_two_nodes_store_listens_on_node_0s_address_only(tmp_path):
    """Two torchrun agents on this machine, as two barrier tasks would run them: static rendezvous."""
    out = tmp_path / "out"
    out.mkdir()
    entry = _script(tmp_path, report_sockets)
    host = _this_machines_address()
    master = (host, free_port(host))
    spec = _spec(num_processes=4, nproc_per_node=2, script_args=[str(out), str(os.getpid())])

    other = multiprocessing.get_context("fork").Process(target=_node, args=(spec, 1, entry, host, master))
    other.start()
    try:
        failures = _node(spec, 0, entry, host, master)
    finally:
        other.join(60)
    assert failures == []
    assert other.exitcode == 0
    records = _records(out, 4)
    assert {tuple(r["master"]) for r in records} == {master}
    assert {r["agent_store"] for r in records} == {"True"}
    for record in records:
        sockets = record["listeners"]
        store = [s for s in sockets if s[2] == master[1]]
        assert store and {ip for _, ip, _ in store} == {host}, sockets
        assert not [s for s in sockets if s[1] in WILDCARDS], sockets


def test_local_mode_restart_gets_a_fresh_store(tmp_path):
    """A restarted worker group must not read the dead group's keys (gloo's addresses) and hang."""
    out = tmp_path / "out"
    out.mkdir()
    entry = _script(tmp_path, fail_once)
    spec = _spec(num_processes=2, local_mode=True, max_restarts=1, script_args=[str(out)])

    failures = _node(spec, 0, entry, "127.0.0.1", None)

    assert failures == []
    assert sorted(p.name for p in out.iterdir()) == ["done0", "done1"]


# -- where the listener goes --------------------------------------------------------------------


def test_listener_is_bound_to_the_address_given():
    with listen_on("127.0.0.1", 0) as s:
        assert s.getsockname()[0] == "127.0.0.1"


def test_an_address_of_another_machine_falls_back_to_every_interface(caplog):
    # TEST-NET-1 (RFC 5737): never an address of this machine.
    assert rendezvous.store_listener("192.0.2.123", 0, world_size=2) is None
    assert "listens on every interface" in caplog.text


def test_a_name_that_resolves_to_loopback_falls_back_when_other_nodes_need_it(caplog):
    assert rendezvous.store_listener("localhost", 0, world_size=2) is None
    assert "resolves to loopback" in caplog.text
    with rendezvous.store_listener("localhost", 0, world_size=1) as s:  # one node: loopback is right
        assert s.getsockname()[0] in ("127.0.0.1", "::1")


def test_a_taken_port_says_where():
    with listen_on("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"rendezvous store on 127.0.0.1:{port}") as info:
            rendezvous.store_listener("127.0.0.1", port, world_size=2)
    assert info.value.errno == errno.EADDRINUSE


def test_the_backend_is_registered_with_torchrun():
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    assert rendezvous.register() == rendezvous.register()  # idempotent
    params = RendezvousParameters(
        backend=rendezvous.BACKEND, endpoint="10.0.0.1:29500", run_id="r", min_nodes=2, max_nodes=2,
        rank=1, timeout=7,
    )  # fmt: skip
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, rendezvous.BoundStoreRendezvous)
    assert (handler.master_addr, handler.master_port) == ("10.0.0.1", 29500)
    assert (handler.rank, handler.world_size) == (1, 2)
    assert handler.use_agent_store  # the ranks connect to this store instead of serving their own
