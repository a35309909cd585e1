"""End to end through TorchDistributorHook: real torchrun agents and ranks, on both engines.

Each core test runs on the embedded spark-submit path (``local[2]``, local mode and distributed)
and over Spark Connect (the session's ``local[2]`` Connect server, distributed; local mode cannot
apply there, so :data:`MODES` has no such case). The Connect runs skip ``no_leftovers``: the server's Python
daemon starts workers that outlive a test by design (``connect_server`` checks its own leftovers)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from airflow_provider_torchdist import TorchDistributorHook, report
from airflow_provider_torchdist.errors import InvalidTrainingConfig, PayloadNotPicklable, TrainingFailed

pytestmark = pytest.mark.integration

#: (engine, local_mode) of the core tests. No local mode over Connect: local mode trains on the Spark
#: driver's machine, and a Connect server's driver runs no user code, so that is refused before
#: anything starts (test_connect.py::test_local_mode_over_connect_is_refused_before_anything_starts;
#: the README's engine table says it too). A skipped case here would prove nothing.
MODES = [
    pytest.param("spark-submit", True, id="local_mode"),
    pytest.param("spark-submit", False, id="distributed"),
    pytest.param("connect", False, id="connect-distributed"),
]
#: The engine alone, for distributed-only tests.
ENGINES = [pytest.param("spark-submit", id="spark-submit"), pytest.param("connect", id="connect")]


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> dict[str, str]:
    """The hook's ``conn_id`` for the test's engine: the embedded master (``spark_default``, as a
    new user has it), or a ``spark_connect`` connection to the session's Connect server."""
    if request.param == "connect":
        return {"conn_id": request.getfixturevalue("connect_conn")}
    request.getfixturevalue("no_leftovers")
    return {}


def _allreduce_rank() -> tuple[int, int, float]:
    """A helper the training function calls: pickled by value along with it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item()


def train_and_report(scale: float, *, offset: float = 0.0) -> dict:
    rank, world_size, total = _allreduce_rank()
    print(f"hello from rank {rank} of {world_size}")
    report(step=1, loss=torch.tensor(0.5) + rank)  # only rank 0's report is kept by default
    return {
        "rank": rank,
        "world_size": world_size,
        "allreduce": total,
        "pid": os.getpid(),
        "tensor": torch.arange(3, dtype=torch.float32) * scale + offset,
        "torch_threads": _most_torch_threads(),
    }


def _most_torch_threads() -> int:
    """The largest intra-op thread count any rank has (torchrun gives 1 per rank to several ranks)."""
    import torch.distributed as dist

    threads = torch.tensor([torch.get_num_threads()])
    dist.all_reduce(threads, op=dist.ReduceOp.MAX)
    return int(threads.item())


def fail_on_rank_one() -> int:
    rank, _, _ = _allreduce_rank()
    if rank == 1:
        raise ValueError("rank one refuses to train")
    return rank


@pytest.mark.parametrize("engine, local_mode", MODES, indirect=["engine"])
def test_callable_returns_rank_zero_value(
    engine: dict[str, str], local_mode: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, use_gpu=False, **engine)
    heard: list[list[dict]] = []  # what on_metrics was told while the run trained
    hook.on_metrics = lambda metrics: heard.append(list(metrics))
    result = hook.run(train_and_report, 2.0, offset=1.0)

    assert result["rank"] == 0
    assert result["world_size"] == 2
    assert result["allreduce"] == 1.0  # 0 + 1: both ranks really joined one process group
    assert torch.equal(result["tensor"], torch.tensor([1.0, 3.0, 5.0]))
    assert result["torch_threads"] == 1  # not the agent's pool, sized before OMP_NUM_THREADS was set
    assert [(m["rank"], m["step"], m["loss"]) for m in hook.metrics] == [(0, 1, 0.5)]
    assert heard == [hook.metrics]
    logs = capfd.readouterr()
    text = logs.out + logs.err
    assert "[rank 0 @ 127.0.0.1] hello from rank 0 of 2" in text
    assert "[rank 1 @ 127.0.0.1] hello from rank 1 of 2" in text
    assert "[metrics] rank 0 step 1: loss=0.5" in text
    # A successful run's log holds no stack trace and no error line (the exit barrier's race:
    # tests/unit/spark/node/test_exit_barrier.py).
    assert "Traceback" not in text and "exit barrier" not in text and "DistNetworkError" not in text, text
    assert not [line for line in text.splitlines() if "[error" in line or " ERROR " in line], text
    if engine:  # the Connect driver's first line, and no spark-submit on this path
        assert "distributed mode over Spark Connect: 2 Spark task(s)" in text
        assert "spark-submit" not in text.replace("spark_submit", "")
    else:
        assert f"local[{1 if local_mode else 2}]" in text  # the embedded master, sized for the job


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_two_ranks_in_one_spark_task_split_its_cpus(engine: dict[str, str]) -> None:
    # Spark sets OMP_NUM_THREADS=spark.task.cpus (2) for the task; its 2 ranks get 1 thread each.
    hook = TorchDistributorHook(num_processes=2, local_mode=False, use_gpu=False, nproc_per_node=2, **engine)
    result = hook.run(train_and_report, 1.0)
    assert (result["world_size"], result["allreduce"]) == (2, 1.0)
    assert result["torch_threads"] == 1


@pytest.mark.parametrize("engine, local_mode", MODES, indirect=["engine"])
def test_rank_one_exception_fails_run_naming_rank(engine: dict[str, str], local_mode: bool) -> None:
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, **engine)
    with pytest.raises(TrainingFailed) as info:
        hook.run(fail_on_rank_one)

    assert info.value.failed_ranks == [1]
    message = str(info.value)
    assert "rank 1 on 127.0.0.1" in message
    assert "ValueError: rank one refuses to train" in message
    assert "in fail_on_rank_one" in message  # the user's traceback travels with the error


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist

    out_dir, exit_rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"script rank {rank} args {sys.argv[1:]}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": dist.get_world_size(), "name": __name__}, f)
    dist.barrier()
    dist.destroy_process_group()
    if rank == exit_rank:
        sys.exit(3)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train_script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("engine, local_mode", MODES, indirect=["engine"])
def test_script_runs_on_every_rank(
    engine: dict[str, str], local_mode: bool, script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, **engine)

    assert hook.run(str(script), str(out), "-1") is None  # scripts return None, as documented

    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert {r["world_size"] for r in reports} == {2}
    assert {r["name"] for r in reports} == {"__main__"}


@pytest.mark.parametrize("engine, local_mode", MODES, indirect=["engine"])
def test_script_rank_one_exit_code_fails_run(
    engine: dict[str, str], local_mode: bool, script: Path, tmp_path: Path
) -> None:
    hook = TorchDistributorHook(num_processes=2, local_mode=local_mode, **engine)
    with pytest.raises(TrainingFailed) as info:
        hook.run(str(script), str(tmp_path), "1")

    assert info.value.failed_ranks == [1]
    assert info.value.failures[0].exitcode == 3
    assert "exit code 3" in str(info.value)


@pytest.mark.usefixtures("no_leftovers")
def test_unpicklable_callable_fails_before_spark_submit() -> None:
    lock = threading.Lock()

    def train_with_lock() -> int:
        with lock:
            return 1

    hook = TorchDistributorHook(num_processes=2)
    with pytest.raises(PayloadNotPicklable, match="closure variable 'lock'") as info:
        hook.run(train_with_lock)
    assert "pickle" in str(info.value)
    assert hook.submission is None  # spark-submit never started


@pytest.mark.usefixtures("no_leftovers")
def test_missing_script_fails_before_spark_submit(tmp_path: Path) -> None:
    hook = TorchDistributorHook(num_processes=2)
    with pytest.raises(InvalidTrainingConfig, match="does not exist"):
        hook.run(str(tmp_path / "nope.py"))
    assert hook.submission is None


@pytest.mark.usefixtures("no_leftovers")
def test_spark_connection_master_is_used(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL3", json.dumps({"conn_type": "spark", "host": "local[3]"}))
    hook = TorchDistributorHook(
        num_processes=2,
        conn_id="spark_local3",
        conf={"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"},
        env_vars={"SPARK_LOCAL_IP": "127.0.0.1"},
    )
    assert not hook.embedded
    assert hook.run(train_and_report, 1.0)["world_size"] == 2
    text = "".join(capfd.readouterr())
    assert "--master local[3]" in text
    assert "master local[3]" in text  # what the driver itself saw


def lightning_train() -> dict:
    """A stock PyTorch Lightning DDP loop, unchanged: it must find torchrun's environment."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), data)
    return {
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_lightning_ddp_trainer_across_two_spark_tasks(engine: dict[str, str]) -> None:
    result = TorchDistributorHook(num_processes=2, local_mode=False, **engine).run(lightning_train)
    assert result["global_rank"] == 0
    assert result["world_size"] == 2
    assert "train_loss" in result["metrics"]
    assert result["metrics"]["train_loss"] >= 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
