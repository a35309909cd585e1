"""A successful two-node run ends quietly: node 0 keeps its rendezvous store until the other node
is out of torchrun's exit barrier.

torch's exit barrier is ``add`` then ``wait`` on node 0's store. The last node to ``add`` releases
node 0, whose agent then returns and whose store goes with it; a node that had added but not yet
sent its ``wait`` (a busy machine: a sweep's trials side by side) then found no store, and a
successful run logged "Error waiting on exit barrier" and a C++ stack trace. The test makes that
interleaving certain instead of likely: node 1 pauses between its ``add`` and its ``wait`` until
node 0 has either dropped its store (the old code) or said it holds it for the others (the fix).
Both nodes are real torchrun agents (``elastic_launch`` with the launcher's configuration: this
package's static rendezvous) with real forked ranks, in processes of their own.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import time
from pathlib import Path

import pytest

from airflow_provider_torchdist.spark.node import rendezvous
from airflow_provider_torchdist.spark.node.network import free_port
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

MARKER_WAIT_S = 60.0  # a bound on waiting for the other node's marker, never reached when it works


class _Recorder(logging.Handler):
    """Every log record of the process, and a marker file when node 0 says it holds its store."""

    def __init__(self, held_marker: Path | None) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, str]] = []
        self.held_marker = held_marker

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage() + (self.format(record) if record.exc_info else "")
        self.records.append({"level": record.levelname, "logger": record.name, "text": text})
        if self.held_marker and record.name == rendezvous.__name__ and "holds the rendezvous store" in text:
            self.held_marker.touch()


def _wait_for_any(*markers: Path) -> None:
    deadline = time.monotonic() + MARKER_WAIT_S
    while not any(m.exists() for m in markers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"none of {markers} appeared")
        time.sleep(0.01)


def _train() -> None:
    """A rank: its work is done at once (the agent's launch configuration is the launcher's own)."""


def _node(spec: JobSpec, node_rank: int, master: tuple[str, int], work: Path) -> None:
    """One barrier task's torchrun agent, configured as ``launch_node`` configures it; writes every
    log record it saw to ``work``."""
    from torch.distributed.elastic.utils import store as store_util
    from torch.distributed.launcher.api import elastic_launch

    from airflow_provider_torchdist.spark.node.launcher import launch_config

    recorder = _Recorder(work / "node0-holds-store" if node_rank == 0 else None)
    # torch's loggers do not propagate past "torch.distributed", and the agent's logs from WARNING.
    for name in ("", "torch.distributed"):
        logging.getLogger(name).addHandler(recorder)
    for name in ("", "torch.distributed.elastic.agent.server.api", rendezvous.__name__):
        logging.getLogger(name).setLevel(logging.DEBUG)
    if node_rank == 1:
        arrive = store_util._barrier_nonblocking

        def arrive_then_pause(*args, **kwargs):  # node 1 is descheduled between add and wait
            key = arrive(*args, **kwargs)
            _wait_for_any(work / "node0-gone", work / "node0-holds-store")
            return key

        store_util._barrier_nonblocking = arrive_then_pause
    config = launch_config(spec, node_rank=node_rank, master=master, host="127.0.0.1", log_dir=str(work))
    elastic_launch(config, _train)()  # raises should a rank fail
    gc.collect()  # the agent, its rendezvous handler and (node 0) the store server are gone now
    (work / f"node{node_rank}-gone").touch()
    (work / f"node{node_rank}.json").write_text(json.dumps(recorder.records))


def test_a_node_late_into_the_exit_barrier_still_finds_node_0s_store(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = JobSpec(
        kind="script", entry="train.py", run_id="run-1", token="t", rendezvous_timeout=60, num_processes=2
    )
    master = ("127.0.0.1", free_port("127.0.0.1"))
    fork = multiprocessing.get_context("fork")
    nodes = [fork.Process(target=_node, args=(spec, n, master, tmp_path)) for n in (0, 1)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(120)
    assert [node.exitcode for node in nodes] == [0, 0]
    printed = "".join(capfd.readouterr())  # torch's C++ side writes its warnings straight to fd 2
    assert "TCPStore" not in printed and "Traceback" not in printed and "exit barrier" not in printed, printed

    for n in (0, 1):
        records = json.loads((tmp_path / f"node{n}.json").read_text())
        loud = [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
        assert loud == [], loud
        text = "\n".join(r["text"] for r in records)
        assert "Error waiting on exit barrier" not in text
        assert "Traceback" not in text and "DistNetworkError" not in text
    node1 = "\n".join(r["text"] for r in json.loads((tmp_path / "node1.json").read_text()))
    assert "Done waiting for other agents" in node1  # node 1 went through the barrier, not around it
