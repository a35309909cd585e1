"""The driver's view of each rank's progress and its verdict on a hung run: a plain object, driven
here without sockets (the whole path, with real ranks, is tests/integration/test_hangs.py)."""

from __future__ import annotations

from airflow_provider_torchdist.spark.driver.hang_detection import HangDetector
from airflow_provider_torchdist.spark.wire.outcome import HUNG_ERROR_PREFIX
from airflow_provider_torchdist.spark.wire.watchdog_messages import Progress, Stacks

TIMEOUT = 30.0


def _progress(
    events: int = 0, moves: int = 0, where: str = "train.py:9 in train", waits_in: str | None = None
):
    return Progress(events, moves, None, where, waits_in, 4242)


def _two_ranks() -> HangDetector:
    ranks = HangDetector()
    ranks.connected("c0", 0, "10.0.0.1", now=0.0)
    ranks.connected("c1", 1, "10.0.0.2", now=0.0)
    return ranks


def test_a_rank_whose_counts_grow_is_never_stalled_however_long_the_run():
    ranks = _two_ranks()
    for t in range(1, 200):  # steps of 10 s (a third of the timeout), for 2000 s
        ranks.progress("c0", _progress(events=t), now=t * 10.0)
        ranks.progress("c1", _progress(moves=t), now=t * 10.0)
        assert ranks.stalled(TIMEOUT, now=t * 10.0 + 9.9) == []


def test_messages_without_progress_do_not_count_and_the_stalled_rank_is_named():
    ranks = _two_ranks()
    for t in range(1, 40):
        ranks.progress("c0", _progress(events=t), now=float(t))  # rank 0 trains
        ranks.progress("c1", _progress(events=3, moves=7), now=float(t))  # rank 1 sends, stuck
    ranks.progress("c1", _progress(events=3, moves=7), now=40.0)
    assert ranks.stalled(TIMEOUT, now=29.9) == []  # its counts stopped growing at its first message
    assert ranks.stalled(TIMEOUT, now=31.0) == [1]


def test_a_rank_that_never_sends_is_stalled_from_its_connection_on():
    ranks = _two_ranks()
    ranks.progress("c0", _progress(events=1), now=25.0)
    assert ranks.stalled(TIMEOUT, now=30.0) == [1]


def test_a_rank_whose_connection_ended_is_not_watched_any_more():
    ranks = _two_ranks()
    ranks.gone("c1")  # it returned
    ranks.progress("c0", _progress(events=1), now=20.0)
    assert ranks.stalled(TIMEOUT, now=45.0) == []
    ranks.progress("c1", _progress(events=1), now=46.0)  # a late message of a gone connection: ignored
    assert ranks.ranks() == {0}


def test_the_rank_not_in_a_collective_is_the_suspect_with_its_host_and_line():
    ranks = _two_ranks()
    ranks.answered("c0", Stacks("main thread ...", "train.py:12 in train", "all_reduce"))
    ranks.answered("c1", Stacks("main thread ...", "train.py:10 in train", None))
    verdict = ranks.verdict(TIMEOUT, [0, 1], now=31.0)
    assert (verdict.waiting, verdict.silent, verdict.suspects) == ([0], [], [1])
    lines = [verdict.summary(state) for state in verdict.ranks]
    assert lines == [
        "[rank 0 @ 10.0.0.1] waits in a collective (torch.distributed all_reduce) at train.py:12 in train "
        "(no progress for 31 s)",
        "[rank 1 @ 10.0.0.2] is not in a collective: at train.py:10 in train (no progress for 31 s)",
    ]
    assert verdict.suspect_line() == (
        "suspect: rank 1 on 10.0.0.2 (not in a collective, or silent, while rank(s) [0] wait in one)"
    )
    error = verdict.error(grace=30.0)
    assert error.startswith(HUNG_ERROR_PREFIX + "no progress from rank(s) [0, 1] for hang_timeout=30 s")
    assert "(rank 1 at train.py:10 in train)" in error and "stop_grace_period=30 s" in error


def test_a_rank_that_does_not_answer_is_silent_and_suspected_with_where_it_was_last():
    ranks = _two_ranks()
    ranks.progress("c1", _progress(events=5, where="train.py:20 in train"), now=1.0)
    ranks.answered("c0", Stacks("...", "train.py:12 in train", "all_reduce"))
    verdict = ranks.verdict(TIMEOUT, [0, 1], now=33.0)
    assert (verdict.silent, verdict.suspects) == ([1], [1])
    assert verdict.summary(verdict.ranks[1]).startswith(
        "[rank 1 @ 10.0.0.2] is silent: nothing from it for 32 s and no answer for its stacks"
    )
    assert verdict.summary(verdict.ranks[1]).endswith("last seen at train.py:20 in train")
    assert "rank 1: silent" in verdict.error(5.0)


def test_every_rank_in_a_collective_is_a_mismatch_named_by_what_each_waits_in():
    ranks = _two_ranks()
    ranks.answered("c0", Stacks("...", "train.py:12 in train", "all_reduce"))
    ranks.answered("c1", Stacks("...", "train.py:14 in train", "broadcast"))
    verdict = ranks.verdict(TIMEOUT, [0, 1], now=31.0)
    assert verdict.suspects == []
    assert verdict.suspect_line().startswith(
        "every rank waits in a collective (rank 0 in all_reduce, rank 1 in broadcast): they called "
        "different collectives"
    )


def test_with_no_collective_anywhere_the_stalled_ranks_are_the_suspects():
    ranks = _two_ranks()
    ranks.answered("c0", Stacks("...", "train.py:30 in load", None))  # still moving (a spin), not stalled
    ranks.answered("c1", Stacks("...", "train.py:31 in load", None))
    verdict = ranks.verdict(TIMEOUT, [1], now=31.0)
    assert verdict.suspects == [1]
    assert verdict.suspect_line() == "suspect: rank 1 on 10.0.0.2 (without progress, in no collective)"


def test_a_reconnected_rank_starts_afresh_and_keeps_its_step_times():
    ranks = HangDetector()
    ranks.connected("old", 0, "h", now=0.0)
    ranks.gone("old")
    ranks.connected("new", 0, "h", now=100.0)
    assert ranks.stalled(TIMEOUT, now=120.0) == []
    ranks.progress("new", Progress(2, 0, 1.5, "t.py:1 in f", None, 7), now=121.0)
    ranks.progress("new", Progress(3, 0, None, "t.py:1 in f", None, 7), now=122.0)
    verdict = ranks.verdict(TIMEOUT, [], now=122.0)
    assert verdict.ranks[0].event_gap_s == 1.5 and ranks.pids() == [7]


def test_collectives_issued_are_progress_even_when_the_rank_sits_on_one_line():
    ranks = _two_ranks()
    for t in range(1, 10):  # steps of 10 s, each one blocking call: no move, no event, one collective
        ranks.progress(
            "c0", Progress(0, 0, None, "train.py:9 in train", None, 1, collectives=t), now=t * 10.0
        )
    ranks.progress("c1", Progress(0, 0, None, "train.py:9 in train", None, 2), now=5.0)
    assert ranks.stalled(TIMEOUT, now=95.0) == [1]
