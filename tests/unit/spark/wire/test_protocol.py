"""The run channel's messages: every kind round-trips, and anything malformed is a clear ValueError."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from airflow_provider_torchdist.spark.wire.outcome import RankFailure
from airflow_provider_torchdist.spark.wire.protocol import (
    AgentFailures,
    Application,
    Bye,
    Line,
    LogLine,
    MasterAnswer,
    MasterEndpoint,
    MasterQuery,
    Metric,
    NodeStarted,
    Output,
    OutputFile,
    ProtocolError,
    RankError,
    decode,
    encode,
    rank_prefix,
)

EVERY_KIND = [
    Line("out", "epoch 1 \x1b[2K done"),
    Line("err", ""),
    RankError("ValueError", "boom", "Traceback ...", exitcode=1),
    RankError(),
    AgentFailures((RankFailure(rank=3, host="h", local_rank=1, exitcode=-9, signal="SIGKILL"),)),
    AgentFailures((RankFailure(rank=None, exc_type="TimeoutError", message="rendezvous"),)),
    NodeStarted(),
    MasterEndpoint("10.0.0.7", 29500),
    MasterQuery(12.5),
    MasterAnswer(host="10.0.0.7", port=29500),
    MasterAnswer(error="another barrier task failed"),
    Metric({"rank": 0, "step": 3, "time": 1.5, "loss": 0.25, "tag": "x", "nan": None}),
    Output(1024, "cloudpickle", "dict", "ab" * 32),
    Output(0),
    OutputFile(".torchdist-output-x.pkl", "json", "list", None),
    Bye(),
    LogLine("[rank 0 @ h] hi"),
    Application("app-20240101-0001", "http://driver:4040"),
    Application("local-123", None),
    Application(
        "local-123", None, "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"
    ),
]


@pytest.mark.parametrize("msg", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips(msg):
    data = encode(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1  # one line, whatever the text
    assert decode(data) == msg


def test_the_wire_format_of_a_line():
    assert json.loads(encode(Line("out", "hi"))) == {"k": "line", "s": "out", "l": "hi"}


def test_the_encoder_coerces_failure_fields_so_the_decoder_accepts_them():
    # SystemExit("message") gives a str exit code; an odd traceback object is sent as text.
    msg = AgentFailures((RankFailure(rank=1, exitcode="bye", traceback=["a"]),))  # type: ignore[arg-type]
    assert decode(encode(msg)) == AgentFailures((RankFailure(rank=1, exitcode=None, traceback="['a']"),))
    assert decode(encode(RankError(exitcode="x"))) == RankError()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"not json", "not a JSON message"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"l": "x"}', "unknown message kind None"),
        (b'{"k": ["line"]}', "unknown message kind ['line']"),
        (b'{"k": "exec"}', "unknown message kind 'exec'"),
        (b'{"k": "line", "s": "out"}', "field 'l' must be str, got NoneType"),
        (b'{"k": "line", "s": "tty", "l": "x"}', "stream must be 'out' or 'err'"),
        (b'{"k": "error", "e": "boom"}', "a failure must be an object, got str"),
        (b'{"k": "error", "e": {"rank": 0}}', "unknown failure field(s) ['rank']"),
        (b'{"k": "error", "e": {"exitcode": "1"}}', "field 'exitcode' must be int or null, got str"),
        (b'{"k": "failures", "failures": {"rank": 1}}', "field 'failures' must be list, got dict"),
        (b'{"k": "failures", "failures": [{"rank": true}]}', "field 'rank' must be int or null, got bool"),
        (b'{"k": "failures", "failures": [{"pid": 1}]}', "unknown failure field(s) ['pid']"),
        (b'{"k": "master", "host": "h", "port": 70000}', "bad endpoint 'h':70000"),
        (b'{"k": "master", "host": "", "port": 1}', "bad endpoint"),
        (b'{"k": "master?", "timeout": "300"}', "field 'timeout' must be int or float, got str"),
        (b'{"k": "master?", "timeout": NaN}', "bad timeout"),
        (b'{"k": "master!"}', "neither an endpoint nor an error"),
        (b'{"k": "metric", "m": [1]}', "field 'm' must be dict, got list"),
        (b'{"k": "metric", "m": {"loss": {"x": 1}}}', "'loss' must be a number, got dict"),
        (b'{"k": "output", "n": -1}', "bad output size -1"),
        (b'{"k": "output", "n": 1.5}', "field 'n' must be int, got float"),
        (b'{"k": "output", "n": true}', "field 'n' must be int, got bool"),
        (b'{"k": "output", "n": 1, "sha256": 5}', "field 'sha256' must be str or null, got int"),
        (b'{"k": "output_file"}', "field 'name' must be str, got NoneType"),
        (b'{"k": "application", "app_id": 1}', "field 'app_id' must be str, got int"),
        (
            b'{"k": "application", "app_id": "a", "operation": 5}',
            "field 'operation' must be str or null, got int",
        ),
        (b'{"k": "application", "app_id": "a", "operation": "x/y"}', "'x/y' is not a Connect operation"),
        (
            b'{"k": "application", "app_id": "a", "operation": "0B8F1C57-6F0E-4A43-9D3E-2A4C1F6B9D10/'
            b'5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"}',
            "is not a Connect operation",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON message"),
    ],
)
def test_malformed_messages_raise_a_clear_protocol_error(raw, message):
    with pytest.raises(ProtocolError) as info:
        decode(raw)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


_ODD_VALUES = [None, True, 0, -1, 2**70, 1.5, "", "x", [], [1], {}, {"a": 1}, [{}], [{"rank": "0"}]]


def test_no_field_value_makes_the_decoder_fail_any_other_way():
    """Every kind, every field set to every odd value: a message or a ProtocolError, nothing else."""
    keys = [
        "s",
        "l",
        "e",
        "failures",
        "host",
        "port",
        "timeout",
        "error",
        "m",
        "n",
        "name",
        "format",
        "app_id",
    ]
    for kind, key, value in itertools.product([type(m).KIND for m in EVERY_KIND], keys, _ODD_VALUES):
        try:
            decode(json.dumps({"k": kind, key: value}))
        except ProtocolError:
            pass


def test_rank_prefix():
    assert rank_prefix(1, "hostX") == "[rank 1 @ hostX]"
    assert rank_prefix(None, "hostX") == "[agent @ hostX]"
    assert rank_prefix(0, None) == "[rank 0]"


@pytest.mark.parametrize(
    "raw, error",
    [
        (b'{"k": "stop", "reason": "timeout", "grace": -1}', "'stop' message: bad grace period -1"),
        (b'{"k": "stop", "reason": "timeout", "grace": NaN}', "'stop' message: bad grace period nan"),
        (b'{"k": "stop", "reason": "timeout"}', "field 'grace'"),
        (b'{"k": "stop", "reason": "' + b"x" * 201 + b'", "grace": 1}', "'stop' message: a reason of 201"),
    ],
)
def test_a_stop_request_that_is_not_one_is_refused(raw, error):
    with pytest.raises(ProtocolError, match=re.escape(error)):
        decode(raw)
