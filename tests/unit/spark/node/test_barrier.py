"""GPU mapping of a barrier task: Spark's assignment within what the cluster made visible."""

from __future__ import annotations

import pytest

from airflow_provider_torchdist.spark.node.barrier import gpu_environment, visible_devices
from airflow_provider_torchdist.spark.wire.jobspec import JobSpec


def _spec(use_gpu: bool = True, nproc_per_node: int = 1) -> JobSpec:
    return JobSpec(
        kind="callable",
        entry="payload.pkl",
        num_processes=2 * nproc_per_node,
        run_id="r",
        token="t",
        use_gpu=use_gpu,
        nproc_per_node=nproc_per_node,
    )


@pytest.fixture
def no_preset(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def test_no_preset_keeps_sparks_assignment():
    assert visible_devices(["0", "1"], None) == ["0", "1"]
    assert visible_devices(["0", "1"], "") == ["0", "1"]
    assert visible_devices([" 2 "], None) == ["2"]


def test_preset_restricts_the_assignment():
    assert visible_devices(["0", "1"], "1,3") == ["1"]
    assert visible_devices(["1", "3"], " 1 , 3 ") == ["1", "3"]
    assert visible_devices(["0"], "1,3") == []


def test_order_of_the_assignment_is_kept():
    assert visible_devices(["3", "1"], "1,3") == ["3", "1"]


def test_cpu_runs_get_no_gpu_environment(no_preset):
    assert gpu_environment(_spec(use_gpu=False), None) == {}
    assert gpu_environment(_spec(use_gpu=False), ["0"]) == {}


def test_assigned_gpus_become_cuda_visible_devices(no_preset):
    assert gpu_environment(_spec(nproc_per_node=2), ["2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_preset_cuda_visible_devices_is_intersected(no_preset):
    no_preset.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpu_environment(_spec(), ["0", "1"]) == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("gpus", [None, []])
def test_no_gpu_assigned_is_a_clear_error(no_preset, gpus):
    with pytest.raises(RuntimeError, match="use_gpu=True but Spark assigned this task no GPU") as e:
        gpu_environment(_spec(), gpus)
    assert "spark.executor.resource.gpu.amount" in str(e.value)
    assert "spark.task.resource.gpu.amount" in str(e.value)


def test_too_few_gpus_is_a_clear_error(no_preset):
    with pytest.raises(RuntimeError, match=r"needs 2 GPU\(s\) per task, but Spark assigned \['0'\]"):
        gpu_environment(_spec(nproc_per_node=2), ["0"])


def test_preset_that_hides_the_assignment_is_a_clear_error(no_preset):
    no_preset.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match=r"CUDA_VISIBLE_DEVICES='3' leaves \[\]"):
        gpu_environment(_spec(), ["0", "1"])


def test_rank_zero_writes_in_place_only_where_the_drivers_output_dir_is_reachable(tmp_path) -> None:
    from airflow_provider_torchdist.spark.node.barrier import shared_output_dir

    private = tmp_path / "torchdist-abc123"
    private.mkdir(mode=0o700)
    assert shared_output_dir(str(private)) == str(private)  # the driver's machine, or shared storage
    assert shared_output_dir(str(tmp_path / "torchdist-elsewhere")) is None  # another host: the channel
    assert shared_output_dir(None) is None
