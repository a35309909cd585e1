"""The Spark Connect server fixture (``connect_server.py``) against pyspark's Connect client: a
barrier ``mapInArrow`` stage runs both its tasks, and ``interruptTag`` cancels a tagged barrier job
and ends the Python workers that were running it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from tests.integration.connect_server import ConnectServer

pytestmark = pytest.mark.integration

TAG = "t1"
#: From the job's submission to both barrier tasks running (Python workers may have to start).
START_TIMEOUT = 60
#: From interruptTag to the job failing, and to its Python workers being gone.
INTERRUPT_TIMEOUT = 20


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_barrier_job_and_interrupt_tag(
    connect_server: ConnectServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # remote() marks this process a Connect client (SPARK_CONNECT_MODE_ENABLED): taken back afterwards,
    # or every later test's spark-submit would inherit it.
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    spark = SparkSession.builder.remote(connect_server.url).getOrCreate()
    try:
        # Both tasks of a barrier stage run at once: each reaches the barrier.
        def where(batches):
            import socket

            import pyarrow as pa
            from pyspark import BarrierTaskContext

            ctx = BarrierTaskContext.get()
            for _ in batches:
                pass
            ctx.barrier()
            yield pa.RecordBatch.from_pydict({"p": [ctx.partitionId()], "host": [socket.gethostname()]})

        rows = (
            spark.range(2, numPartitions=2).mapInArrow(where, "p long, host string", barrier=True).collect()
        )
        assert sorted(row.p for row in rows) == [0, 1]

        # A tagged barrier job whose tasks sleep 60 s, each writing its Python worker's PID first.
        marker_dir = str(tmp_path)

        def sleeper(batches):
            import os
            import time

            import pyarrow as pa
            from pyspark import BarrierTaskContext

            ctx = BarrierTaskContext.get()
            path = os.path.join(marker_dir, f"pid-{ctx.partitionId()}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            time.sleep(60)
            yield pa.RecordBatch.from_pydict({"p": [ctx.partitionId()], "host": [""]})

        outcome: dict[str, object] = {}

        def run_job() -> None:
            spark.addTag(TAG)  # tags are per thread: the job's own thread carries it
            try:
                outcome["rows"] = (
                    spark.range(2, numPartitions=2)
                    .mapInArrow(sleeper, "p long, host string", barrier=True)
                    .collect()
                )
            except Exception as exc:
                outcome["error"] = exc
            finally:
                outcome["ended"] = time.monotonic()

        job = threading.Thread(target=run_job, name="tagged-job", daemon=True)
        job.start()

        markers = [tmp_path / f"pid-{p}" for p in (0, 1)]
        deadline = time.monotonic() + START_TIMEOUT
        while not all(m.exists() for m in markers):
            assert job.is_alive(), f"the job ended before both tasks started: {outcome}"
            assert time.monotonic() < deadline, f"both tasks not running after {START_TIMEOUT} s"
            time.sleep(0.2)
        pids = [int(m.read_text()) for m in markers]
        assert not any(_gone(pid) for pid in pids)

        interrupted = time.monotonic()
        op_ids = spark.interruptTag(TAG)
        assert op_ids, "interruptTag found no operation"

        job.join(INTERRUPT_TIMEOUT)
        assert not job.is_alive(), f"the job still runs {INTERRUPT_TIMEOUT} s after interruptTag"
        assert "rows" not in outcome, f"the job finished: {outcome['rows']}"
        error = outcome["error"]
        assert isinstance(error, PySparkException) and error.getCondition() == "OPERATION_CANCELED", repr(
            error
        )
        assert outcome["ended"] - interrupted < INTERRUPT_TIMEOUT

        deadline = interrupted + INTERRUPT_TIMEOUT
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, (
                f"Python workers {[p for p in pids if not _gone(p)]} alive {INTERRUPT_TIMEOUT} s after interruptTag"
            )
            time.sleep(0.2)
        print(
            f"canceled in {outcome['ended'] - interrupted:.1f} s, "
            f"workers gone in {time.monotonic() - interrupted:.1f} s: {type(error).__name__}"
        )
    finally:
        spark.stop()
