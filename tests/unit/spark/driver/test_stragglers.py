"""The straggler check and each rank's step time, driven with progress states on a made-up clock
(the real check runs in tests/integration/test_hangs.py)."""

from __future__ import annotations

import re

from airflow_provider_torchdist.spark.driver.hang_detection import HangDetector, RankProgress
from airflow_provider_torchdist.spark.driver.stragglers import (
    SUSTAIN_S,
    StragglerCheck,
    is_rank_summary,
    step_time_records,
)
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress


def _ranks(seconds: float, shares: list[float], step_s: list[float]) -> list[RankProgress]:
    """Each rank after ``seconds`` of sampling twice a second, computing ``shares[r]`` of the time,
    one event per ``step_s[r]`` seconds."""
    samples = int(seconds * 2)
    return [
        RankProgress(
            rank,
            f"10.0.0.{rank}",
            seconds,
            seconds,
            events=int(seconds / step_s[rank]),
            samples=samples,
            busy=int(samples * share),
            where="train.py:9 in step",
        )
        for rank, share in enumerate(shares)
    ]


def _run(
    check: StragglerCheck, shares: list[float], step_s: list[float], until: float
) -> dict[float, list[int]]:
    named = {}
    for second in range(1, int(until) + 1):
        if found := check.check(_ranks(second, shares, step_s), now=float(second)):
            named[float(second)] = found
    return named


def test_a_rank_computing_three_times_as_long_as_the_others_is_named_once_after_the_sustain():
    said: list[str] = []
    named = _run(StragglerCheck(said.append), [0.33, 0.99, 0.31, 0.35], [0.15] * 4, until=90)
    assert list(named.values()) == [[1]]
    first = next(iter(named))
    assert SUSTAIN_S <= first <= SUSTAIN_S + 15  # the window fills in, then the sustain
    assert len(said) == 1
    assert re.match(
        r"straggler: \[rank 1 @ 10\.0\.0\.1\] has run 3\.\dx slower than the other ranks for 2\d s", said[0]
    )
    assert re.search(
        r"it computes (99|100)% of the time while the others wait in collectives 6\d% of theirs", said[0]
    )


def test_ranks_that_step_apart_are_compared_by_step_time():
    said: list[str] = []
    named = _run(StragglerCheck(said.append), [1.0, 1.0], [0.1, 0.3], until=60)  # no collectives: busy alike
    assert list(named.values()) == [[1]] and "3.0x slower" in said[0], said


def test_even_ranks_and_a_short_slow_spell_are_not_named():
    said: list[str] = []
    check = StragglerCheck(said.append)
    assert _run(check, [0.5, 0.52, 0.48], [0.2] * 3, until=60) == {}
    # 1.4x: under the factor.
    assert _run(StragglerCheck(said.append), [0.5, 0.7], [0.2] * 2, until=60) == {}
    assert said == []


def test_a_lone_rank_or_one_without_samples_is_never_compared():
    said: list[str] = []
    assert _run(StragglerCheck(said.append), [0.9], [0.1], until=60) == {}
    assert (
        StragglerCheck(said.append).check([RankProgress(0, None, 0, 0), RankProgress(1, None, 0, 0)], 5.0)
        == []
    )


def test_each_ranks_mean_step_time_outlives_its_connection():
    ranks = HangDetector()
    for rank in (0, 1):
        ranks.connected(f"conn-{rank}", rank, "h", now=0.0)
        ranks.progress(f"conn-{rank}", Progress(0, 1, None, "x", None, 10 + rank, samples=2, busy=2), now=1.0)
        ranks.progress(
            f"conn-{rank}", Progress(10, 5, 0.1, "x", None, 10 + rank, samples=10, busy=8), now=2.0
        )
        ranks.progress(
            f"conn-{rank}",
            Progress(30, 9, 0.1, "x", None, 10 + rank, samples=20, busy=5 + 10 * rank),
            now=6.0,
        )
    ranks.gone("conn-0")  # rank 0 returned: what it did stays
    records = step_time_records(ranks.every_rank())
    assert [(r["rank"], r["mean_step_time_s"], r["compute_share"]) for r in records] == [
        (0, 0.2, 0.25),
        (1, 0.2, 0.75),
    ]
    assert all(isinstance(r["time"], float) and is_rank_summary(r) and "step" not in r for r in records)
    # A report that happens to use the same names is still a report.
    assert not is_rank_summary({"rank": 0, "step": None, "time": 1.0, "compute_share": 0.5})


def test_a_rank_that_never_progressed_has_no_record():
    assert step_time_records([RankProgress(0, None, 0, 0)]) == []
