"""The driver's wait for barrier slots, against a fake SparkContext whose slot count changes over time."""

from __future__ import annotations

import pytest

from airflow_provider_torchdist.spark.driver import slots
from airflow_provider_torchdist.spark.driver.slots import SlotsUnavailable, wait_for_slots


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeContext:
    """``counts`` maps a time to the slot count from then on."""

    def __init__(self, master: str, counts: dict[float, int], clock: FakeClock) -> None:
        self.master = master
        self._counts = sorted(counts.items())
        self._clock = clock

    def slots(self) -> int:
        return [n for t, n in self._counts if t <= self._clock.now][-1]

    def getConf(self):  # noqa: N802 (pyspark's name)
        return {"spark.task.cpus": "1"}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(slots, "time", clock)
    monkeypatch.setattr(slots, "available_slots", lambda sc: sc.slots())
    return clock


def test_returns_as_soon_as_enough_executors_registered(clock: FakeClock) -> None:
    sc = FakeContext("spark://m:7077", {0: 0, 3: 2, 4: 4}, clock)
    assert wait_for_slots(sc, 4, 20, lambda text: None) == 4
    assert clock.now == pytest.approx(4, abs=0.3)


def test_too_small_cluster_fails_once_the_count_settles(clock: FakeClock) -> None:
    sc = FakeContext("spark://m:7077", {0: 0, 2: 2, 3: 4}, clock)
    with pytest.raises(
        SlotsUnavailable, match=r"needs 6 task slot\(s\) at once but the cluster has 4"
    ) as info:
        wait_for_slots(sc, 6, 20, lambda text: None, settle=6)
    assert 9 <= clock.now <= 9.5  # 6 s after the last executor arrived, not the full 20 s
    assert "master-web-ui" in str(info.value)


def test_a_straggler_gets_as_long_as_the_first_executor_took(clock: FakeClock) -> None:
    """On a loaded cluster the first executor took 10 s to register; the second, granted with it,
    arrives 8 s later: more than the 6 s settle, less than the first one's 10 s."""
    sc = FakeContext("spark://m:7077", {0: 0, 10: 1, 18: 2}, clock)
    assert wait_for_slots(sc, 2, 60, lambda text: None, settle=6) == 2
    assert clock.now == pytest.approx(18, abs=0.3)


def test_a_slow_start_still_fails_once_the_longer_settle_passed(clock: FakeClock) -> None:
    sc = FakeContext("spark://m:7077", {0: 0, 10: 1}, clock)
    with pytest.raises(SlotsUnavailable, match="has 1"):
        wait_for_slots(sc, 2, 60, lambda text: None, settle=6)
    assert 20 <= clock.now <= 20.5  # 10 s after the only executor, not 6 s and not the full 60 s


def test_no_executor_yet_waits_up_to_the_timeout(clock: FakeClock) -> None:
    said: list[str] = []
    sc = FakeContext("yarn", {0: 0}, clock)
    with pytest.raises(SlotsUnavailable, match="has 0"):
        wait_for_slots(sc, 2, 20, said.append)
    assert 20 <= clock.now <= 20.5
    assert said and "waiting for executors: 0 of 2" in said[0]


def test_known_to_fit_waits_for_busy_slots_without_limit(clock: FakeClock) -> None:
    sc = FakeContext("spark://m:7077", {0: 1, 100: 2}, clock)
    assert wait_for_slots(sc, 2, None, lambda text: None) == 2
    assert clock.now >= 100


def test_local_master_shortfall_fails_at_once(clock: FakeClock) -> None:
    sc = FakeContext("local[2]", {0: 2}, clock)
    with pytest.raises(SlotsUnavailable, match="has 2"):
        wait_for_slots(sc, 3, 20, lambda text: None)
    assert clock.now == 0
