"""The XCom envelope: JSON values travel as they are, anything else round-trips through load_output."""

from __future__ import annotations

import base64
import enum
import hashlib
import io
import json
import math
import os
import pickle
import stat
from collections import OrderedDict
from pathlib import Path

import cloudpickle
import pytest
import torch

from airflow_provider_torchdist.outputs import signing
from airflow_provider_torchdist.outputs import storage as output_storage
from airflow_provider_torchdist.outputs.results import (
    DEFAULT_MAX_XCOM_OUTPUT_BYTES,
    ENVELOPE_KEY,
    ENVELOPE_VERSION,
    OutputSignatureError,
    is_json_native,
    load_output,
    output_origin,
    output_to_xcom,
)
from airflow_provider_torchdist.outputs.storage import VerifiedChunks
from airflow_provider_torchdist.spark.driver.channel import ChannelClient, RunChannel
from airflow_provider_torchdist.spark.node.storage_pickling import dump_output
from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE
from airflow_provider_torchdist.spark.wire.output_store import (
    MANIFEST_SUFFIX,
    OutputManifest,
    encode_json,
    publish_output,
    type_name,
)
from tests.unit.conftest import fast_shutdown

ORIGIN = {"dag_id": "retrain", "run_id": "manual__1", "task_id": "train", "map_index": -1, "try": 1}


def published(directory: Path, value, fmt: str | None = None) -> Path:
    """What rank 0 and the driver leave in the staging directory: the encoded value and its manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    fmt = fmt or ("json" if is_json_native(value) else "cloudpickle")
    if fmt == "json":
        data = encode_json(value)
    else:
        buf = io.BytesIO()
        dump_output(value, buf)
        data = buf.getvalue()
    part = directory / ".part"
    part.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    return publish_output(part, directory, format=fmt, type=type_name(value), sha256=sha, generation="0.0")


def to_xcom(value, tmp_path: Path, **kwargs):
    """What the operator returns for rank 0's ``value`` (inline unless told otherwise)."""
    kwargs.setdefault("max_inline_bytes", DEFAULT_MAX_XCOM_OUTPUT_BYTES)
    kwargs.setdefault("store_uri", f"file://{tmp_path}/store/train-try1.pkl")
    return output_to_xcom(published(tmp_path / "staging", value), origin=ORIGIN, **kwargs)


def _through_xcom(value, tmp_path: Path):
    """What a downstream task receives: rank 0's output, output_to_xcom, then XCom's JSON round trip."""
    return json.loads(json.dumps(to_xcom(value, tmp_path), allow_nan=False))


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
def test_json_native_values_pass_unchanged(value, tmp_path):
    out = to_xcom(value, tmp_path)
    assert out == value
    assert type(out) is type(value)
    assert not (isinstance(out, dict) and ENVELOPE_KEY in out)
    assert _through_xcom(value, tmp_path / "again") == value


def test_no_output_file_means_no_value():
    assert output_to_xcom(None, origin=ORIGIN, max_inline_bytes=10, store_uri="file:///x") is None


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
def test_other_values_go_in_an_envelope(value, tmp_path):
    out = to_xcom(value, tmp_path)
    assert isinstance(out, dict) and out[ENVELOPE_KEY] == ENVELOPE_VERSION
    assert out["format"] == "cloudpickle"
    assert not is_json_native(value)


def test_a_json_dict_that_looks_like_an_envelope_is_wrapped(tmp_path):
    value = {ENVELOPE_KEY: 2, "format": "cloudpickle"}  # rank 0's own data, not an envelope
    out = to_xcom(value, tmp_path)
    assert out["format"] == "json" and out["type"] == "dict"
    assert load_output(json.loads(json.dumps(out))) == value


def test_envelope_is_small_json_with_documented_fields(tmp_path):
    value = torch.arange(10)
    out = to_xcom(value, tmp_path)
    text = json.dumps(out, allow_nan=False)  # XCom stores JSON: this must not raise
    assert set(out) == {ENVELOPE_KEY, "format", "type", "size", "sha256", "data", "origin", "sig"}
    assert out[ENVELOPE_KEY] == 2
    assert out["format"] == "cloudpickle"
    assert out["type"] == "torch.Tensor"
    pickled = base64.b64decode(out["data"])
    assert out["size"] == len(pickled) and out["sha256"] == hashlib.sha256(pickled).hexdigest()
    assert out["origin"] == ORIGIN
    assert len(text) < len(pickled) * 2 + 600


def test_builtin_type_names_are_short(tmp_path):
    assert to_xcom((1,), tmp_path / "a")["type"] == "tuple"
    assert to_xcom(b"", tmp_path / "b")["type"] == "bytes"


def test_tensor_round_trips_exactly(tmp_path):
    value = torch.randn(3, 4, dtype=torch.float64)
    back = load_output(_through_xcom(value, tmp_path))
    assert isinstance(back, torch.Tensor)
    assert back.dtype == torch.float64 and back.shape == (3, 4)
    assert torch.equal(back, value)


def test_state_dict_round_trips_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    state = model.state_dict()
    back = load_output(_through_xcom(state, tmp_path))
    assert type(back) is type(state)
    assert list(back) == list(state)
    for key in state:
        assert back[key].dtype == state[key].dtype
        assert torch.equal(back[key], state[key]), key
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    fresh.load_state_dict(back)  # usable as a state_dict


@pytest.mark.parametrize("value", [(1, "a"), {1: 2}, b"\x00\xff", {"a": float("nan")}])
def test_envelope_round_trips_python_values(value, tmp_path):
    back = load_output(_through_xcom(value, tmp_path))
    if isinstance(value, dict) and "a" in value:
        assert math.isnan(back["a"])
    else:
        assert back == value and type(back) is type(value)


@pytest.mark.parametrize("value", [None, 3, "x", [1, 2], {"a": 1}, {"format": "cloudpickle"}])
def test_load_output_leaves_plain_values_alone(value):
    assert load_output(value) is value
    assert output_origin(value) is None


def test_origin_is_signed_and_checked_on_request(tmp_path):
    out = json.loads(json.dumps(to_xcom((1, 2), tmp_path)))
    assert output_origin(out) == ORIGIN
    assert load_output(out, expect={"dag_id": "retrain", "run_id": "manual__1", "try": 1}) == (1, 2)
    with pytest.raises(OutputSignatureError, match="run_id='manual__1', not the expected 'manual__2'"):
        load_output(out, expect={"run_id": "manual__2"})
    with pytest.raises(ValueError, match="unknown field 'run'"):
        load_output(out, expect={"run": "manual__1"})
    with pytest.raises(OutputSignatureError, match="plain JSON"):
        load_output({"loss": 0.1}, expect={"run_id": "manual__1"})


def test_wrong_envelope_version_is_refused_clearly(tmp_path):
    out = to_xcom((1, 2), tmp_path)
    out[ENVELOPE_KEY] = ENVELOPE_VERSION + 1
    with pytest.raises(OutputSignatureError, match=r"unknown envelope version 3"):
        load_output(out)


def test_wrong_envelope_format_is_refused(tmp_path):
    out = to_xcom((1, 2), tmp_path)
    out["format"] = "pickle"
    with pytest.raises(OutputSignatureError, match="unknown format 'pickle'"):
        load_output(out)


class _Color(enum.IntEnum):
    RED = 1


def test_int_subclass_round_trips_with_its_type(tmp_path):
    back = load_output(_through_xcom(_Color.RED, tmp_path))
    assert back is _Color.RED


# -- signatures and large outputs ------------------------------------------------------------------


def test_tampered_envelope_is_refused_before_unpickling(tmp_path) -> None:
    out = to_xcom(torch.arange(4), tmp_path)
    evil = dict(out, data=base64.b64encode(cloudpickle.dumps(torch.arange(5))).decode())
    with pytest.raises(OutputSignatureError, match="do not match the signed digest|not the size"):
        load_output(evil)
    unsigned = {k: v for k, v in out.items() if k != "sig"}
    with pytest.raises(OutputSignatureError):
        load_output(unsigned)


def test_envelope_from_another_deployment_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-a" * 4)
    out = to_xcom(torch.arange(4), tmp_path)
    assert torch.equal(load_output(out), torch.arange(4))
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", "deployment-b" * 4)
    with pytest.raises(OutputSignatureError, match="another"):
        load_output(out)


def test_default_key_file_is_private_and_stable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    key = signing.signing_key()
    assert len(key) == 64 and signing.signing_key() == key
    assert oct((tmp_path / signing.KEY_FILE).stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.iterdir()) == [signing.KEY_FILE]  # no temporary file left


def test_large_output_goes_by_signed_reference(tmp_path) -> None:
    value = {"weights": torch.randn(64, 64)}
    ref = to_xcom(
        value, tmp_path, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/run/train-try1.pkl"
    )
    assert "data" not in ref and ref["ref"].endswith("train-try1.pkl")
    assert len(json.dumps(ref)) < 800  # XCom holds a small reference, not the tensor
    assert torch.equal(load_output(ref)["weights"], value["weights"])
    stored = tmp_path / "store/run/train-try1.pkl"
    stored.write_bytes(cloudpickle.dumps({"weights": torch.zeros(1)}))  # someone swaps the file
    with pytest.raises(OutputSignatureError):
        load_output(ref)


def test_a_large_json_output_goes_by_reference_and_loads_as_json(tmp_path) -> None:
    value = {"history": list(range(2000))}
    ref = to_xcom(value, tmp_path, max_inline_bytes=100)
    assert ref["format"] == "json" and "ref" in ref
    assert load_output(ref) == value


# -- the large-output path: digest from the run, rename, one verified read ---------------------------


def _stored_state(tmp_path, size_floats: int = 64 * 64) -> tuple[dict, Path]:
    value = {"weights": torch.randn(size_floats)}
    return value, published(tmp_path / "staging", value)


def _store(src: Path, tmp_path: Path, name: str = "train-try1.pkl", **kwargs) -> dict:
    return output_to_xcom(
        src, origin=ORIGIN, max_inline_bytes=1024, store_uri=f"file://{tmp_path}/store/{name}", **kwargs
    )


def test_output_on_the_same_filesystem_is_moved_not_copied(tmp_path) -> None:
    value, src = _stored_state(tmp_path)
    inode = src.stat().st_ino
    ref = _store(src, tmp_path)
    stored = tmp_path / "store/train-try1.pkl"
    assert not src.exists() and stored.stat().st_ino == inode  # a rename: no second copy
    assert ref["sha256"] == hashlib.sha256(stored.read_bytes()).hexdigest()
    assert torch.equal(load_output(json.loads(json.dumps(ref)))["weights"], value["weights"])


def test_output_to_other_storage_is_streamed(tmp_path, monkeypatch) -> None:
    # Object storage (s3://...) or another filesystem: streamed through ObjectStoragePath both ways.
    import airflow_provider_torchdist.outputs.results as results

    monkeypatch.setattr(results, "local_path", lambda dest: None)
    monkeypatch.setattr(output_storage, "local_path", lambda dest: None)
    value, src = _stored_state(tmp_path)
    ref = _store(src, tmp_path)
    assert src.exists()  # copied, not moved
    assert ref["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (tmp_path / "store/train-try1.pkl").read_bytes() == src.read_bytes()
    assert torch.equal(load_output(ref)["weights"], value["weights"])


def test_a_copy_across_filesystems_is_private_and_ignores_planted_symlinks(tmp_path, monkeypatch) -> None:
    value, src = _stored_state(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite")
    base = tmp_path / "outputs"
    (base / "retrain").mkdir(parents=True)
    (base / "retrain" / "train-try1.pkl").symlink_to(victim)  # planted at the output's name
    monkeypatch.setattr(output_storage, "same_filesystem", lambda fd, path: False)  # another filesystem
    ref = output_to_xcom(
        src,
        origin=ORIGIN,
        max_inline_bytes=1024,
        store_uri=f"file://{base}/retrain/train-try1.pkl",
        store_base=f"file://{base}",
    )
    monkeypatch.undo()
    stored = base / "retrain" / "train-try1.pkl"
    assert victim.read_text() == "do not overwrite"
    assert not stored.is_symlink() and stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert src.exists()  # copied
    assert torch.equal(load_output(ref)["weights"], value["weights"])


def test_a_symlinked_directory_below_output_path_is_refused(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    base = tmp_path / "outputs"
    base.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "retrain").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(PermissionError, match="'retrain' there is not a plain directory"):
        output_to_xcom(
            src,
            origin=ORIGIN,
            max_inline_bytes=1024,
            store_uri=f"file://{base}/retrain/run/train-try1.pkl",
            store_base=f"file://{base}",
        )
    assert list(elsewhere.iterdir()) == []


def test_directories_made_below_output_path_are_0700(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    base = tmp_path / "outputs"
    output_to_xcom(
        src,
        origin=ORIGIN,
        max_inline_bytes=1024,
        store_uri=f"file://{base}/dag/run/train-try1.pkl",
        store_base=f"file://{base}",
    )
    for d in (base / "dag", base / "dag" / "run"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def _staged_non_pickle(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    """A staged output whose manifest says cloudpickle but whose bytes would raise if unpickled."""
    src = tmp_path / name / OUTPUT_FILE
    src.parent.mkdir()
    data = b"\x80\x05 not a pickle at all " * 100
    src.write_bytes(data)
    st = src.stat()
    manifest = {
        "format": "cloudpickle",
        "type": "dict",
        "size": st.st_size,
        "sha256": hashlib.sha256(data).hexdigest(),
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
        "generation": "0.0",
    }
    src.with_name(OUTPUT_FILE + MANIFEST_SUFFIX).write_text(json.dumps(manifest))
    return src, data


@pytest.mark.parametrize("inline", [False, True], ids=["by-reference", "inline"])
def test_an_output_is_never_unpickled_on_the_airflow_side(tmp_path, monkeypatch, inline) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the Airflow side unpickled an output")

    monkeypatch.setattr(cloudpickle, "loads", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    src, data = _staged_non_pickle(tmp_path, "staging")
    value = output_to_xcom(
        src,
        origin=ORIGIN,
        max_inline_bytes=10**6 if inline else 1024,
        store_uri=f"file://{tmp_path}/store/out.pkl",
    )
    # Signed as the bytes they are: inline as base64, or by reference to the stored file.
    assert (value["size"], value["type"]) == (len(data), "dict")
    assert output_origin(value) == ORIGIN
    if inline:
        assert base64.b64decode(value["data"]) == data and "ref" not in value
    else:
        assert (tmp_path / "store/out.pkl").read_bytes() == data and "data" not in value


@pytest.mark.parametrize(
    "change",
    [{"size": 1}, {"ino": 1}, {"mtime_ns": 1}, {"sha256": "not hex"}, {"sha256": None}, {"format": "pickle"}],
)
def test_an_output_without_a_valid_manifest_is_not_used(tmp_path, change) -> None:
    _, src = _stored_state(tmp_path)
    manifest_file = src.with_name(OUTPUT_FILE + MANIFEST_SUFFIX)
    manifest_file.write_text(json.dumps({**json.loads(manifest_file.read_text()), **change}))
    assert OutputManifest.read(src) is None
    with pytest.raises(RuntimeError, match="no valid manifest"):
        _store(src, tmp_path)


def test_a_stored_file_of_another_size_is_refused_before_unpickling(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    ref = _store(src, tmp_path, "out.pkl")
    stored = tmp_path / "store/out.pkl"
    original = stored.read_bytes()
    for data in (original[:-1], original + b"."):
        stored.write_bytes(data)
        with pytest.raises(OutputSignatureError, match="not the .* bytes that were signed"):
            load_output(ref)


def test_a_forged_reference_is_refused_before_the_file_is_opened(tmp_path) -> None:
    _, src = _stored_state(tmp_path)
    ref = _store(src, tmp_path, "out.pkl")
    for change in ({"ref": f"file://{tmp_path}/nowhere.pkl"}, {"size": 10**12}, {"sha256": "0" * 64}):
        with pytest.raises(OutputSignatureError):  # not FileNotFoundError, not a 1 TB allocation
            load_output({**ref, **change})


def test_verified_chunks_check_before_returning_and_read_like_a_file() -> None:
    chunk = output_storage._COPY_CHUNK
    data = os.urandom(3 * chunk + 5) + b"line one\nline two"  # several chunks
    seen = []
    chunks = VerifiedChunks.from_stream(io.BytesIO(data), len(data), seen.append, OutputSignatureError)
    assert seen == [hashlib.sha256(data).hexdigest()]
    first = chunks.read(10)
    buf = bytearray(3 * chunk - 10)
    assert chunks.readinto(buf) == len(buf)  # across chunk boundaries
    rest = chunks.read(5)
    assert first + bytes(buf) + rest == data[: 3 * chunk + 5]
    assert chunks.readline() == b"line one\n" and chunks.readline() == b"line two"
    assert chunks.read() == b"" and chunks.readline() == b""

    def refuse(digest):
        raise OutputSignatureError("no")

    with pytest.raises(OutputSignatureError):
        VerifiedChunks.from_stream(io.BytesIO(data), len(data), refuse, OutputSignatureError)


def test_tensors_travel_from_their_own_memory_and_load_into_shared_buffers() -> None:
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
    """DigestingWriter hashes the pickle as it is written; the driver records it in the manifest."""
    from airflow_provider_torchdist.spark.node.rank_output import DigestingWriter, send_output

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
    channel = RunChannel("tok", "127.0.0.1", out_dir, out=io.StringIO(), ranks_of_node=lambda n: range(1))
    with fast_shutdown(channel):
        key = channel.registry.add_local(0, "localhost").key
        client = ChannelClient.as_rank(
            channel.address, "tok", node=0, rank=0, generation=0, host="localhost", node_key=key
        )
        send_output(client, value)  # streamed: not on the driver's filesystem
        client.close()
    manifest = OutputManifest.read(out_dir / OUTPUT_FILE)
    assert manifest is not None and manifest.format == "cloudpickle" and manifest.type == "dict"
    assert manifest.sha256 == hashlib.sha256((out_dir / OUTPUT_FILE).read_bytes()).hexdigest()
    ref = output_to_xcom(
        out_dir / OUTPUT_FILE, origin=ORIGIN, max_inline_bytes=100, store_uri=f"file://{tmp_path}/s/o.pkl"
    )
    assert torch.equal(load_output(ref)["w"], value["w"])


def test_rank0_on_the_drivers_machine_writes_its_value_in_place(tmp_path) -> None:
    """Local mode: no channel copy; the driver takes rank 0's file and writes its manifest."""
    from airflow_provider_torchdist.spark.node.rank_output import send_output

    value = {"w": torch.randn(1000)}
    channel = RunChannel("tok", "127.0.0.1", tmp_path, out=io.StringIO(), ranks_of_node=lambda n: range(1))
    with fast_shutdown(channel):
        key = channel.registry.add_local(0, "localhost").key
        client = ChannelClient.as_rank(
            channel.address, "tok", node=0, rank=0, generation=0, host="localhost", node_key=key
        )
        send_output(client, value, str(tmp_path))
        client.close()
    final = tmp_path / OUTPUT_FILE
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUT_FILE, OUTPUT_FILE + MANIFEST_SUFFIX]
    assert oct(final.stat().st_mode & 0o777) == "0o600"
    assert OutputManifest.read(final).sha256 == hashlib.sha256(final.read_bytes()).hexdigest()
    ref = output_to_xcom(
        final, origin=ORIGIN, max_inline_bytes=100, store_uri=f"file://{tmp_path}/store/out.pkl"
    )
    assert torch.equal(load_output(ref)["w"], value["w"])
