"""Run-time rows of the bad-input table (docs/bad-inputs.md): what can only be known once ranks run."""

from __future__ import annotations

import pytest

from airflow_provider_torchdist import TorchDistributorHook
from airflow_provider_torchdist.errors import TrainingFailed

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leftovers")]


def return_a_lock():
    import threading

    return {"model": "fine", "lock": threading.Lock()}  # every rank trains; rank 0's value cannot travel


@pytest.mark.parametrize(
    "local_mode", [pytest.param(True, id="local_mode"), pytest.param(False, id="distributed")]
)
def test_unpicklable_return_value_fails_naming_rank_0_and_pickling(local_mode: bool) -> None:
    with pytest.raises(TrainingFailed) as info:
        TorchDistributorHook(num_processes=2, local_mode=local_mode).run(return_a_lock)

    assert info.value.failed_ranks == [0]
    message = str(info.value)
    assert (
        "rank 0 on 127.0.0.1 failed: TypeError: rank 0's return value (dict) could not be pickled" in message
    )
    assert "cannot pickle '_thread.lock' object" in message  # what could not be pickled
    assert "Return plain data" in message  # what to do
