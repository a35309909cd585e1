"""The XCom envelope: JSON values travel as they are, anything else round-trips through load_output."""

from __future__ import annotations

import base64
import enum
import hashlib
import io
import json
import math
import os
from collections import OrderedDict
from pathlib import Path

import cloudpickle
import pytest
import torch

from airflow_provider_torchdist import results
from airflow_provider_torchdist.results import (
    ENVELOPE_KEY,
    ENVELOPE_VERSION,
    OutputSignatureError,
    VerifiedChunks,
    is_json_native,
    load_output,
    output_to_xcom,
    recorded_digest,
    to_xcom,
)
from airflow_provider_torchdist.spark.channel import ChannelClient
from airflow_provider_torchdist.spark.jobspec import OUTPUT_DIGEST_SUFFIX, OUTPUT_FILE
from tests.unit.conftest import fast_shutdown


def _through_xcom(value):
    """What a downstream task receives: rank 0's pickle, to_xcom, then XCom's JSON round trip."""
    return json.loads(json.dumps(to_xcom(cloudpickle.dumps(value)), allow_nan=False))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -7,
        2**70,
        1.5,
        "text ✓",
        [],
        {},
        [1, "a", None, [2.5, {"k": [True]}]],
        {"loss": 0.1, "history": [1, 2, 3], "nested": {"a": {"b": None}}},
    ],
)
def test_json_native_values_pass_unchanged(value):
    out = to_xcom(cloudpickle.dumps(value))
    assert out == value
    assert type(out) is type(value)
    assert not (isinstance(out, dict) and ENVELOPE_KEY in out)
    assert _through_xcom(value) == value


def test_none_pickle_means_no_value():
    assert to_xcom(None) is None


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        torch.tensor([1.0, 2.0]),
        float("nan"),
        float("inf"),
        {1: "int key"},
        b"bytes",
        {"a": (1, 2)},
        [1, b"x"],
        OrderedDict(a=1),
        {1, 2},
    ],
    ids=["tuple", "tensor", "nan", "inf", "int-key", "bytes", "nested-tuple", "nested-bytes", "odict", "set"],
)
def test_other_values_go_in_an_envelope(value):
    out = to_xcom(cloudpickle.dumps(value))
    assert isinstance(out, dict) and out[ENVELOPE_KEY] == ENVELOPE_VERSION
    assert not is_json_native(value)


def test_envelope_is_small_json_with_documented_fields():
    value = torch.arange(10)
    pickled = cloudpickle.dumps(value)
    out = to_xcom(pickled)
    text = json.dumps(out, allow_nan=False)  # XCom stores JSON: this must not raise
    assert set(out) == {ENVELOPE_KEY, "format", "type", "size", "data", "sig"}
    assert out[ENVELOPE_KEY] == 1
    assert out["format"] == "cloudpickle"
    assert out["type"] == "torch.Tensor"
    assert out["size"] == len(pickled)
    assert base64.b64decode(out["data"]) == pickled
    assert len(text) < len(pickled) * 2 + 200


def test_builtin_type_names_are_short():
    assert to_xcom(cloudpickle.dumps((1,)))["type"] == "tuple"
    assert to_xcom(cloudpickle.dumps(b""))["type"] == "bytes"


def test_tensor_round_trips_exactly():
    value = torch.randn(3, 4, dtype=torch.float64)
    back = load_output(_through_xcom(value))
    assert isinstance(back, torch.Tensor)
    assert back.dtype == torch.float64 and back.shape == (3, 4)
    assert torch.equal(back, value)


def test_state_dict_round_trips_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    state = model.state_dict()
    back = load_output(_through_xcom(state))
    assert type(back) is type(state)
    assert list(back) == list(state)
    for key in state:
        assert back[key].dtype == state[key].dtype
        assert torch.equal(back[key], state[key]), key
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    fresh.load_state_dict(back)  # usable as a state_dict


@pytest.mark.parametrize("value", [(1, "a"), {1: 2}, b"\x00\xff", {"a": float("nan")}])
def test_envelope_round_trips_python_values(value):
    back = load_output(_through_xcom(value))
    if isinstance(value, dict) and "a" in value:
        assert math.isnan(back["a"])
    else:
        assert back == value and type(back) is type(value)


@pytest.mark.parametrize("value", [None, 3, "x", [1, 2], {"a": 1}, {"format": "cloudpickle"}])
def test_load_output_leaves_plain_values_alone(value):
    assert load_output(value) is value


def test_wrong_envelope_version_is_refused_clearly():
    out = to_xcom(cloudpickle.dumps((1, 2)))
    out[ENVELOPE_KEY] = ENVELOPE_VERSION + 1
    with pytest.raises(ValueError, match=r"Unsupported torchdist output envelope \(version 2.*upgrade"):
        load_output(out)


def test_wrong_envelope_format_is_refused():
    out = to_xcom(cloudpickle.dumps((1, 2)))
    out["format"] = "pickle"
    with pytest.raises(ValueError, match="format 'pickle'"):
        load_output(out)


class _Color(enum.IntEnum):
    RED = 1


def test_int_subclass_round_trips_with_its_type():
    back = load_output(_through_xcom(_Color.RED))
    assert back is _Color.RED


# -- signatures and large outputs ------------------------------------------------------------------


def _signed_tensor_envelope() -> dict:
    return to_xcom(cloudpickle.dumps(torch.arange(4)))


def test_tampered_envelope_is_refused_before_unpickling() -> None:
    from airflow_provider_torchdist.results import OutputSignatureError

    out = _signed_tensor_envelope()
    evil = dict(out, data=base64.b64encode(cloudpickle.dumps(torch.arange(5))).decode())
    with pytest.raises(OutputSignatureError, match="signature does not match"):
        load_output(evil)
    unsigned = {k: v for k, v in out.items() if k != "sig"}
    with pytest.raises(OutputSignatureError):
        load_output(unsigned)


def test_envelope_from_another_deployment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchdist.results import OutputSignatureError

    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-a")
    out = _signed_tensor_envelope()
    assert torch.equal(load_output(out), torch.arange(4))
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-b")
    with pytest.raises(OutputSignatureError, match="another"):
        load_output(out)


def test_default_key_file_is_private_and_stable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from airflow_provider_torchdist.results import KEY_FILE, signing_key

    monkeypatch.delenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    key = signing_key()
    assert len(key) == 64 and signing_key() == key
    assert oct((tmp_path / KEY_FILE).stat().st_mode & 0o777) == "0o600"


def test_large_output_goes_by_signed_reference(tmp_path) -> None:
    from airflow_provider_torchdist.results import OutputSignatureError, output_to_xcom

    value = {"weights": torch.randn(64, 64)}
    src = tmp_path / "output.pkl"
    src.write_bytes(cloudpickle.dumps(value))
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/run/train-try1.pkl")
    assert "data" not in ref and ref["ref"].endswith("train-try1.pkl")
    assert len(json.dumps(ref)) < 600  # XCom holds a small reference, not the tensor
    assert torch.equal(load_output(ref)["weights"], value["weights"])
    stored = tmp_path / "store/run/train-try1.pkl"
    stored.write_bytes(cloudpickle.dumps({"weights": torch.zeros(1)}))  # someone swaps the file
    with pytest.raises(OutputSignatureError):
        load_output(ref)


# -- the large-output path: digest from the run, rename, one verified read ---------------------------


def _stored_state(tmp_path, size_floats: int = 64 * 64) -> tuple[dict, Path]:
    value = {"weights": torch.randn(size_floats)}
    src = tmp_path / "staging" / OUTPUT_FILE
    src.parent.mkdir()
    src.write_bytes(cloudpickle.dumps(value, protocol=5))
    return value, src


def test_output_on_the_same_filesystem_is_moved_not_copied(tmp_path) -> None:
    value, src = _stored_state(tmp_path)
    inode = src.stat().st_ino
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/train-try1.pkl")
    stored = tmp_path / "store/train-try1.pkl"
    assert not src.exists() and stored.stat().st_ino == inode  # a rename: no second copy
    assert ref["sha256"] == hashlib.sha256(stored.read_bytes()).hexdigest()
    assert torch.equal(load_output(json.loads(json.dumps(ref)))["weights"], value["weights"])


def test_output_to_other_storage_is_streamed_and_hashed(tmp_path, monkeypatch) -> None:
    # Object storage (s3://...) or another filesystem: streamed through ObjectStoragePath both ways.
    monkeypatch.setattr(results, "_local_path", lambda dest: None)
    value, src = _stored_state(tmp_path)
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/train-try1.pkl")
    assert src.exists()  # copied, not moved
    assert ref["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (tmp_path / "store/train-try1.pkl").read_bytes() == src.read_bytes()
    assert torch.equal(load_output(ref)["weights"], value["weights"])


def test_large_output_is_never_unpickled_on_the_airflow_side(tmp_path) -> None:
    src = tmp_path / OUTPUT_FILE
    src.write_bytes(b"\x80\x05 not a pickle at all " * 100)  # would raise if anything unpickled it
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/out.pkl")
    assert ref["size"] == 2300 and "type" not in ref


def test_the_runs_recorded_digest_is_signed_without_rehashing(tmp_path, monkeypatch) -> None:
    value, src = _stored_state(tmp_path)
    st = src.stat()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    record = {"sha256": digest, "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
    src.with_name(OUTPUT_FILE + OUTPUT_DIGEST_SUFFIX).write_text(json.dumps(record))
    assert recorded_digest(src) == digest

    def no_rehash(path):
        raise AssertionError("hashed the file again")

    monkeypatch.setattr(results, "_file_digest", no_rehash)
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/out.pkl")
    assert ref["sha256"] == digest
    assert torch.equal(load_output(ref)["weights"], value["weights"])


@pytest.mark.parametrize(
    "change",
    [
        {"size": 1},
        {"ino": 1},
        {"mtime_ns": 1},
        {"sha256": "not hex"},
        {"sha256": None},
    ],
)
def test_a_stale_or_odd_digest_record_is_ignored(tmp_path, change) -> None:
    value, src = _stored_state(tmp_path)
    st = src.stat()
    record = {"sha256": "0" * 64, "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
    src.with_name(OUTPUT_FILE + OUTPUT_DIGEST_SUFFIX).write_text(json.dumps({**record, **change}))
    assert recorded_digest(src) is None
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/out.pkl")
    assert torch.equal(load_output(ref)["weights"], value["weights"])  # hashed afresh: still loads


def test_a_stored_file_of_another_size_is_refused_before_unpickling(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/out.pkl")
    stored = tmp_path / "store/out.pkl"
    original = stored.read_bytes()
    for data in (original[:-1], original + b"."):
        stored.write_bytes(data)
        with pytest.raises(OutputSignatureError, match="not the .* bytes that were signed"):
            load_output(ref)


def test_a_forged_reference_is_refused_before_the_file_is_opened(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    ref = output_to_xcom(src, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/out.pkl")
    for change in ({"ref": f"file://{tmp_path}/nowhere.pkl"}, {"size": 10**12}, {"sha256": "0" * 64}):
        with pytest.raises(OutputSignatureError):  # not FileNotFoundError, not a 1 TB allocation
            load_output({**ref, **change})


def test_verified_chunks_check_before_returning_and_read_like_a_file() -> None:
    data = os.urandom(3 * results._COPY_CHUNK + 5) + b"line one\nline two"  # several chunks
    seen = []
    chunks = VerifiedChunks.from_stream(io.BytesIO(data), len(data), seen.append)
    assert seen == [hashlib.sha256(data).hexdigest()]
    first = chunks.read(10)
    buf = bytearray(3 * results._COPY_CHUNK - 10)
    assert chunks.readinto(buf) == len(buf)  # across chunk boundaries
    rest = chunks.read(5)
    assert first + bytes(buf) + rest == data[: 3 * results._COPY_CHUNK + 5]
    assert chunks.readline() == b"line one\n" and chunks.readline() == b"line two"
    assert chunks.read() == b"" and chunks.readline() == b""

    def refuse(digest):
        raise OutputSignatureError("no")

    with pytest.raises(OutputSignatureError):
        VerifiedChunks.from_stream(io.BytesIO(data), len(data), refuse)


def test_tensors_travel_from_their_own_memory_and_load_into_shared_buffers() -> None:
    from airflow_provider_torchdist.spark.storage_pickling import dump_output

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    w = torch.randn(5, 6)
    value = {
        "state": model.state_dict(),
        "w": w,
        "view": w[1:3, ::2],
        "param": torch.nn.Parameter(torch.randn(2)),
        "ints": torch.arange(5),
        "empty": torch.empty(0),
        "bools": torch.tensor([True, False]),
        "half": torch.randn(3).half(),
        "fn": lambda x: x + 1,  # still cloudpickle: code by value
    }
    out = io.BytesIO()
    dump_output(value, out)
    back = cloudpickle.load(VerifiedChunks([out.getvalue()]))
    for key in ("w", "view", "ints", "empty", "bools", "half"):
        assert back[key].dtype == value[key].dtype and back[key].stride() == value[key].stride(), key
        assert torch.equal(back[key], value[key]), key
    assert isinstance(back["param"], torch.nn.Parameter) and torch.equal(back["param"], value["param"])
    torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).load_state_dict(back["state"])
    assert back["fn"](1) == 2
    back["w"].add_(1)  # the loaded tensors are ordinary, writable tensors
    assert torch.equal(back["w"], value["w"] + 1)


def test_rank0_digest_travels_with_its_output_to_the_driver(tmp_path) -> None:
    """DigestingWriter hashes the pickle as it is written; the driver records the digest beside it."""
    from airflow_provider_torchdist.spark.channel import RunChannel
    from airflow_provider_torchdist.spark.rank import DigestingWriter

    value = {"w": torch.randn(300_000), "b": bytearray(b"x" * 100_000), "m": memoryview(b"abc").tobytes()}
    pickle_path = tmp_path / "rank0.pkl"
    with open(pickle_path, "wb") as f:
        writer = DigestingWriter(f)
        cloudpickle.dump(value, writer, protocol=5)
        writer.write(memoryview(bytearray(b"tail")))  # a mutable view is copied before hashing
        digest = writer.hexdigest()
    assert digest == hashlib.sha256(pickle_path.read_bytes()).hexdigest()

    out_dir = tmp_path / "driver"
    out_dir.mkdir()
    with fast_shutdown(RunChannel("tok", "127.0.0.1", out_dir, out=io.StringIO())) as channel:
        client = ChannelClient(channel.address, "tok", 0, "hostX")
        assert client.output_file(str(pickle_path), sha256=digest)
        client.close()
    assert recorded_digest(out_dir / OUTPUT_FILE) == digest


def test_rank0_on_the_drivers_machine_writes_its_value_in_place(tmp_path) -> None:
    """Local mode: no channel copy; the output and its digest record appear atomically, nothing else."""
    from airflow_provider_torchdist.spark.rank import send_output

    value = {"w": torch.randn(1000)}
    send_output(None, value, str(tmp_path))  # no channel needed
    final = tmp_path / OUTPUT_FILE
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUT_FILE, OUTPUT_FILE + OUTPUT_DIGEST_SUFFIX]
    assert oct(final.stat().st_mode & 0o777) == "0o600"
    assert recorded_digest(final) == hashlib.sha256(final.read_bytes()).hexdigest()
    ref = output_to_xcom(final, max_inline_bytes=100, store_uri=f"file://{tmp_path}/store/out.pkl")
    assert torch.equal(load_output(ref)["w"], value["w"])
