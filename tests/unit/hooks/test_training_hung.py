"""A run the driver found hung fails with ``TrainingHung`` on both paths: ``hook.run()`` reads the
driver's outcome, a supervised run's owner reads the supervisor's status (which carries the same error)."""

from __future__ import annotations

import pytest

from airflow_provider_torchdist.errors import TrainingFailed, TrainingHung
from airflow_provider_torchdist.hooks.in_process import raise_for_outcome
from airflow_provider_torchdist.spark.wire.outcome import HUNG_ERROR_PREFIX, Outcome, RankFailure
from airflow_provider_torchdist.supervision.lifeline.run_state import RunState
from airflow_provider_torchdist.supervision.task_side import raise_for_failure

HUNG = (
    f"{HUNG_ERROR_PREFIX}no progress from rank(s) [0, 1] for hang_timeout=300 s; suspect: rank 1 on "
    "10.0.0.2 (not in a collective, or silent, while rank(s) [0] wait in one) (rank 1 at train.py:45 in train)"
)
KILLED = [RankFailure(rank=1, host="10.0.0.2", signal="SIGKILL")]


def test_hook_run_raises_training_hung_for_a_hung_outcome_and_training_failed_otherwise():
    with pytest.raises(TrainingHung) as info:
        raise_for_outcome(Outcome(ok=False, error=HUNG, failures=KILLED), None, staged=None)  # type: ignore[arg-type]
    # The message is the hang's; how the ranks were ended stays in ``failures``.
    assert str(info.value) == f"Distributed training failed: {HUNG}"
    assert info.value.failed_ranks == [1] and isinstance(info.value, TrainingFailed)
    with pytest.raises(TrainingFailed) as other:
        raise_for_outcome(Outcome(ok=False, failures=KILLED), None, staged=None)  # type: ignore[arg-type]
    assert not isinstance(other.value, TrainingHung)


def test_a_supervised_runs_owner_raises_training_hung_from_the_status():
    state = RunState()
    state.finish("failed", error=HUNG, error_kind="training", failures=[vars(f) for f in KILLED])
    with pytest.raises(TrainingHung, match="suspect: rank 1 on 10.0.0.2"):
        raise_for_failure(state.status())
