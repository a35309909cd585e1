"""The run ledger: what ranks and agents reported, and the failures it makes of it. No sockets."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_provider_torchdist.spark.driver.ledger import VANISHED_MESSAGE, RunLedger
from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import MasterAnswer, RankError

HOST = "10.0.0.2"


def test_errors_and_agent_failures_are_merged_per_rank():
    ledger = RunLedger()
    ledger.rank_raised(1, HOST, RankError("ValueError", "boom", "Traceback: ...boom"), at=1.0)
    ledger.rank_raised(2, HOST, RankError("KeyError", "'k'", "tb2"), at=2.0)
    ledger.agents_failed(
        [
            RankFailure(rank=3, host=HOST, local_rank=1, exitcode=-9, signal="SIGKILL"),
            RankFailure(rank=1, host=HOST, local_rank=0, exitcode=1),
        ]
    )
    assert ledger.failures == [
        RankFailure(
            rank=1,
            host=HOST,
            local_rank=0,
            exitcode=1,
            exc_type="ValueError",
            message="boom",
            traceback="Traceback: ...boom",
        ),
        RankFailure(rank=3, host=HOST, local_rank=1, exitcode=-9, signal="SIGKILL"),
    ]
    # Rank 2 raised, but its agent did not report it failed (a restart may have fixed it): not a failure.
    assert 2 in ledger.rank_errors


def test_a_rank_error_alone_is_no_failure():
    ledger = RunLedger()
    ledger.rank_raised(0, HOST, RankError("RuntimeError", "transient"))
    assert ledger.failures == []


def test_agent_failure_without_a_rank_is_kept():
    ledger = RunLedger()
    ledger.agents_failed([RankFailure(rank=None, host=HOST, exc_type="TimeoutError", message="rendezvous")])
    ledger.agents_failed([RankFailure(rank=None, host="h2", exc_type="RuntimeError", message="no GPU")])
    assert [f.host for f in ledger.failures] == [HOST, "h2"]  # one record per agent, none merged


def test_root_cause_first_a_killed_rank_before_the_peers_it_broke():
    """Rank 1 is SIGKILLed (its connection vanishes first); rank 0 then raises in a collective."""
    ledger = RunLedger()
    ledger.rank_vanished(1, "h1", at=5.0)
    ledger.rank_raised(0, "h0", RankError("RuntimeError", "Connection closed by peer"), at=6.0)
    ledger.agents_failed([RankFailure(rank=0, host="h0", exitcode=1)])  # its agent blames only rank 0
    failures = ledger.failures
    assert [f.rank for f in failures] == [1, 0]
    assert failures[0] == RankFailure(rank=1, host="h1", message=VANISHED_MESSAGE)
    assert failures[1].exc_type == "RuntimeError"


def test_a_rank_its_own_agent_ended_after_a_peer_failed_is_no_failure_of_its_own():
    """Local mode: rank 0 raises (its value could not be pickled); the agent, the node's only one,
    blames rank 0 and ends rank 1 with SIGTERM, whose connection closes without a goodbye (hunt 26,
    under load: rank 1 had not finished yet). Only rank 0 failed; rank 1 is its casualty."""
    ledger = RunLedger()
    ledger.rank_raised(0, HOST, RankError("TypeError", "rank 0's return value could not be pickled"), at=5.0)
    ledger.rank_vanished(1, HOST, at=5.2, node=0)
    ledger.agents_failed([RankFailure(rank=0, host=HOST, exitcode=1)], node=0)
    assert [(f.rank, f.exc_type) for f in ledger.failures] == [(0, "TypeError")]


def test_a_rank_whose_agent_went_with_it_is_a_failure_whenever_the_driver_saw_it_go():
    """Its node's agent never reported (it died too): the vanished rank is counted, and first even
    when its connection's close reached the driver a moment after a peer's report of the loss."""
    ledger = RunLedger()
    ledger.rank_raised(0, "h0", RankError("RuntimeError", "Connection reset by peer"), at=5.0)
    ledger.rank_vanished(1, "h1", at=5.01, node=1)
    ledger.agents_failed([RankFailure(rank=0, host="h0", exitcode=1)], node=0)
    assert [f.rank for f in ledger.failures] == [1, 0]


def test_a_rank_killed_by_a_signal_comes_first_even_when_a_peers_report_of_the_loss_arrived_first():
    """Distributed, one rank per node: rank 1 SIGKILLs itself; rank 0's gloo read fails at once. Under
    load the driver read rank 0's report 4 ms before it saw rank 1's connection close (hunt 27)."""
    ledger = RunLedger()
    ledger.rank_raised(0, "h", RankError("RuntimeError", "Read error: Connection reset by peer"), at=5.0)
    ledger.rank_vanished(1, "h", at=5.004, node=1)
    ledger.agents_failed([RankFailure(rank=0, host="h", exitcode=1)], node=0)
    ledger.agents_failed([RankFailure(rank=1, host="h", exitcode=-9, signal="SIGKILL")], node=1)
    failures = ledger.failures
    assert [f.rank for f in failures] == [1, 0] and failures[
        0
    ].summary() == "rank 1 on h failed: killed by SIGKILL"


@pytest.mark.parametrize("vanished_at", [4.984, 5.016], ids=["seen-first", "seen-after-the-report"])
def test_a_killed_rank_its_agent_did_not_name_is_the_root_cause_of_a_peers_lost_connection(vanished_at):
    """Local mode, one agent for both ranks: rank 1 SIGKILLs itself, rank 0's gloo read fails at
    once, and torch's agent names only rank 0 (the first of the two it found dead). Rank 1 is no
    casualty here: rank 0 failed over a lost peer (hunt 28, under a CPU hog)."""
    ledger = RunLedger()
    ledger.rank_raised(
        0, HOST, RankError("RuntimeError", "Connection closed by peer [127.0.0.1]:3201"), at=5.0
    )
    ledger.rank_vanished(1, HOST, at=vanished_at, node=0)
    ledger.agents_failed([RankFailure(rank=0, host=HOST, exitcode=1)], node=0)
    failures = ledger.failures
    assert [f.rank for f in failures] == [1, 0] and failures[0].message == VANISHED_MESSAGE


def test_a_rank_that_raised_first_stays_first_after_a_peer_killed_much_later():
    ledger = RunLedger()
    ledger.rank_raised(0, "h", RankError("ValueError", "bad batch"), at=5.0)
    ledger.rank_vanished(1, "h", at=9.0, node=1)
    ledger.agents_failed([RankFailure(rank=0, host="h", exitcode=1)], node=0)
    ledger.agents_failed([RankFailure(rank=1, host="h", exitcode=-9, signal="SIGKILL")], node=1)
    assert [f.rank for f in ledger.failures] == [0, 1]


def test_the_earliest_trouble_comes_first_whatever_the_report_order():
    ledger = RunLedger()
    ledger.rank_raised(3, HOST, RankError("ValueError", "first"), at=1.0)
    ledger.rank_raised(2, HOST, RankError("ValueError", "second"), at=2.0)
    ledger.agents_failed([RankFailure(rank=2, exitcode=1), RankFailure(rank=None, message="agent")])
    ledger.agents_failed([RankFailure(rank=3, exitcode=1)])
    assert [f.rank for f in ledger.failures] == [3, 2, None]


def test_a_vanished_rank_that_reported_its_error_is_not_counted_twice():
    ledger = RunLedger()
    ledger.rank_raised(1, HOST, RankError("ValueError", "boom"), at=1.0)
    ledger.rank_vanished(1, HOST, at=2.0)
    ledger.rank_vanished(1, HOST, at=3.0)  # only the first counts
    ledger.agents_failed([RankFailure(rank=1, exitcode=1)])
    assert [(f.rank, f.exc_type) for f in ledger.failures] == [(1, "ValueError")]
    assert ledger.vanished[1] == (HOST, 2.0)


def test_nodes_and_metrics():
    ledger = RunLedger()
    assert ledger.node_started(1, "h1") == 0
    assert ledger.node_started(0, "h0") == 0
    assert ledger.node_started(1, "h1b") == 1  # the stage's second attempt
    assert ledger.started_nodes == {0, 1} and ledger.node_hosts == {0: "h0", 1: "h1b"}
    ledger.metric({"rank": 0, "step": 1, "loss": 0.5})
    ledger.metric({"rank": 0, "step": 2, "loss": 0.4})
    assert [m["step"] for m in ledger.metrics] == [1, 2]


def test_the_endpoint_of_each_generation():
    ledger = RunLedger()
    ledger.master_announced(0, "h0", 1)
    assert ledger.wait_for_master(0, 1) == MasterAnswer(host="h0", port=1)
    got: list[MasterAnswer] = []
    thread = threading.Thread(target=lambda: got.append(ledger.wait_for_master(1, 30)))
    thread.start()
    time.sleep(0.1)
    assert not got  # generation 1 never gets generation 0's endpoint
    ledger.master_announced(1, "h1", 2)
    thread.join(5)
    assert got == [MasterAnswer(host="h1", port=2)]


def test_waiting_for_the_endpoint_ends_with_the_reason():
    ledger = RunLedger()
    assert ledger.wait_for_master(0, 0.05).error == (
        "barrier task 0 did not report its rendezvous endpoint within 0s"
    )
    ledger.close()
    assert ledger.wait_for_master(0, 30).error == "the driver is shutting down"
    ledger.agents_failed([RankFailure(rank=None, message="no GPU")])
    assert ledger.wait_for_master(0, 30).error == "another barrier task failed before the rendezvous"
