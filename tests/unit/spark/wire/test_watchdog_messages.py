"""The hang watchdog's messages: they round-trip through the run channel's one encoder and decoder,
and every field is checked on the way in."""

from __future__ import annotations

import pytest

from airflow_provider_torchdist.spark.wire.protocol import ProtocolError, decode, encode
from airflow_provider_torchdist.spark.wire.watchdog_messages import (
    MAX_STACKS_CHARS,
    WHERE_CHARS,
    Progress,
    StackRequest,
    Stacks,
)


@pytest.mark.parametrize(
    "msg",
    [
        Progress(3, 17, 0.25, "/dags/train.py:12 in train", "all_reduce", 4242),
        Progress(0, 0, None, "?:0 in ?", None, 1),
        Progress(9, 4, 0.5, "/dags/train.py:12 in train", None, 7, 30, samples=40, busy=13),
        StackRequest(),
        Stacks("main thread (1), most recent call last:\n  ...", "/dags/train.py:12 in train", "broadcast"),
        Stacks("x" * MAX_STACKS_CHARS, "w", None, "/tmp/torchdist-nccl-trace-1-x/nccl_trace_rank_0"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_watchdog_kind_round_trips_as_one_line(msg):
    data = encode(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert decode(data) == msg


def test_a_progress_message_is_a_few_bytes():
    where = "/home/me/dags/train.py:120 in train_step"
    assert len(encode(Progress(123456, 654321, 1.234, where, None, 99999, 9999, 99999, 9999))) < 200


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"k": "progress", "e": -1, "m": 0, "w": "x", "pid": 1}', "bad counts or pid"),
        (b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 0}', "bad counts or pid"),
        (b'{"k": "progress", "e": 1.5, "m": 0, "w": "x", "pid": 1}', "field 'e' must be int, got float"),
        (b'{"k": "progress", "e": true, "m": 0, "w": "x", "pid": 1}', "field 'e' must be int, got bool"),
        (b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "gap": NaN}', "bad event gap nan"),
        (b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "gap": -1}', "bad event gap -1"),
        (b'{"k": "progress", "e": 0, "m": 0, "w": 5, "pid": 1}', "field 'w' must be str, got int"),
        (
            b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "in": ["a"]}',
            "field 'in' must be str or null",
        ),
        (
            b'{"k": "progress", "e": 0, "m": 0, "pid": 1, "w": "' + b"x" * (WHERE_CHARS + 1) + b'"}',
            f"where of {WHERE_CHARS + 1} characters",
        ),
        (
            b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "s": 3, "b": 4}',
            "bad sample counts (4 of 3)",
        ),
        (b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "s": 3, "b": -1}', "bad sample counts"),
        (b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "b": 2}', "bad sample counts (2 of None)"),
        # Ints beyond any float made the driver's straggler arithmetic raise OverflowError, which
        # stopped its hang watch for the rest of the run.
        (b'{"k": "progress", "e": 1' + b"0" * 400 + b', "m": 0, "w": "x", "pid": 1}', "a count beyond"),
        (
            b'{"k": "progress", "e": 0, "m": 0, "w": "x", "pid": 1, "s": 1' + b"0" * 400 + b', "b": 1}',
            "a count beyond",
        ),
        (b'{"k": "stacks", "w": "x"}', "field 't' must be str, got NoneType"),
        (
            b'{"k": "stacks", "w": "x", "t": "' + b"x" * (MAX_STACKS_CHARS + 1) + b'"}',
            f"text of {MAX_STACKS_CHARS + 1} characters",
        ),
        (b'{"k": "stacks", "w": "x", "t": "", "nccl": 3}', "field 'nccl' must be str or null, got int"),
    ],
)
def test_malformed_watchdog_messages_raise_a_clear_protocol_error(raw, message):
    with pytest.raises(ProtocolError, match=None) as info:
        decode(raw)
    assert message in str(info.value)
