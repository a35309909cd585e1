"""Forged XCom values, as an attacker who can write XCom (the REST API can) would make them.

Each forged value carries a pickle whose loading would create a marker file. For every forgery,
``load_output`` raises and the marker never appears: nothing was unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import cloudpickle
import pytest

from airflow_provider_torchdist.outputs import signing
from airflow_provider_torchdist.outputs.results import (
    ENVELOPE_KEY,
    OutputSignatureError,
    _signed_fields,
    load_output,
    output_origin,
)
from airflow_provider_torchdist.outputs.signing import SigningKeyError, sign
from tests.unit.outputs.test_results import ORIGIN, to_xcom


class _Payload:
    """Unpickling this creates ``path``: the stand-in for an attacker's code running."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


@pytest.fixture
def evil(marker: Path) -> bytes:
    return cloudpickle.dumps(_Payload(marker))


@pytest.fixture
def genuine(tmp_path: Path) -> dict:
    """A real envelope, through XCom's JSON: the template every forgery starts from."""
    return json.loads(json.dumps(to_xcom((1, 2), tmp_path / "genuine")))


def _with_evil(env: dict, evil: bytes, **changes) -> dict:
    forged = dict(env)
    forged["data"] = base64.b64encode(evil).decode()
    forged["size"] = len(evil)
    forged["sha256"] = hashlib.sha256(evil).hexdigest()
    forged.update(changes)
    return forged


def _refused(value, marker: Path, match: str | None = None, **kwargs) -> None:
    with pytest.raises((OutputSignatureError, SigningKeyError, ValueError), match=match):
        load_output(value, **kwargs)
    assert not marker.exists(), "the forged pickle was loaded"


def test_the_genuine_envelope_loads(genuine, marker):
    assert load_output(genuine) == (1, 2)
    assert not marker.exists()


def test_an_unsigned_pickle_with_a_valid_digest_is_refused(genuine, evil, marker):
    _refused(_with_evil(genuine, evil), marker, "signature does not match")


@pytest.mark.parametrize("field", [ENVELOPE_KEY, "format", "type", "size", "sha256", "origin", "sig", "data"])
def test_a_missing_field_is_refused(genuine, evil, marker, field):
    forged = _with_evil(genuine, evil)
    del forged[field]
    if field == ENVELOPE_KEY:  # no longer claims to be an envelope: plain JSON, returned as it is
        assert load_output(forged) is forged
        assert not marker.exists()
        return
    _refused(forged, marker)


@pytest.mark.parametrize(
    "field,empty",
    [("sig", ""), ("type", ""), ("sha256", ""), ("data", ""), ("origin", {}), ("format", "")],
)
def test_an_empty_field_is_refused(genuine, evil, marker, field, empty):
    _refused(_with_evil(genuine, evil, **{field: empty}), marker)


@pytest.mark.parametrize(
    "changes",
    [
        {ENVELOPE_KEY: "2"},
        {ENVELOPE_KEY: True},
        {"size": "12"},
        {"size": True},
        {"size": -1},
        {"size": 1.0},
        {"sha256": 12},
        {"sig": None},
        {"sig": ["a"]},
        {"type": 3},
        {"data": 5},
        {"origin": ["retrain", "manual__1", "train", -1, 1]},
        {"origin": {**ORIGIN, "map_index": "-1"}},
        {"origin": {**ORIGIN, "try": None}},
        {"origin": {**ORIGIN, "run_id": ""}},
        {"origin": {k: v for k, v in ORIGIN.items() if k != "try"}},
        {"origin": {**ORIGIN, "extra": 1}},
        {"extra_field": "x"},
        {"ref": "file:///tmp/x.pkl"},  # both data and ref
    ],
    ids=lambda c: "-".join(f"{k}={v!r}"[:40] for k, v in c.items()),
)
def test_a_mistyped_or_extra_field_is_refused(genuine, evil, marker, changes):
    _refused(_with_evil(genuine, evil, **changes), marker)


def test_the_v1_envelope_without_size_and_an_empty_sig_is_refused(evil, marker):
    """The critical forgery on main before this fix: no size, ``"sig": ""``."""
    v1 = {ENVELOPE_KEY: 1, "format": "cloudpickle", "data": base64.b64encode(evil).decode(), "sig": ""}
    _refused(v1, marker, "version 1 envelope.*no longer accepted")


@pytest.mark.parametrize("fmt", ["pickle", "torch", "json5", None, 1])
def test_a_foreign_format_is_refused(genuine, evil, marker, fmt):
    _refused(_with_evil(genuine, evil, format=fmt), marker)


def test_a_json_format_envelope_never_unpickles(genuine, evil, marker):
    # Even a correctly signed "json" envelope decodes with a JSON parser only.
    key = signing.signing_key()
    forged = _with_evil(genuine, evil, format="json")
    forged["sig"] = sign(key, _signed_fields(forged))
    with pytest.raises(ValueError):
        load_output(forged)
    assert not marker.exists()


@pytest.mark.parametrize("bad_key", [b"", b"short", b"x" * 31])
def test_envelopes_signed_with_an_empty_or_short_key_are_refused(genuine, evil, marker, bad_key):
    forged = _with_evil(genuine, evil)
    forged["sig"] = sign(bad_key, _signed_fields(forged))
    _refused(forged, marker, "signature does not match")


@pytest.mark.parametrize("configured", ["", " ", "short", "x" * 31])
def test_a_short_configured_key_is_refused_before_anything_loads(genuine, marker, monkeypatch, configured):
    monkeypatch.setenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", configured)
    if configured == "":  # unset in effect: the key file is used, and the envelope (signed with it) loads
        assert load_output(genuine) == (1, 2)
        return
    with pytest.raises(SigningKeyError, match="needs at least 32.*OUTPUT_SIGNING_KEY"):
        load_output(genuine)
    assert not marker.exists()


def test_a_reference_pointing_elsewhere_is_refused(tmp_path, evil, marker):
    ref = json.loads(json.dumps(to_xcom({"w": [0.5] * 10}, tmp_path, max_inline_bytes=10)))
    assert "ref" in ref and ref["format"] == "json"
    planted = tmp_path / "planted.pkl"
    planted.write_bytes(evil)
    forged = {
        **ref,
        "ref": f"file://{planted}",
        "format": "cloudpickle",
        "size": len(evil),
        "sha256": hashlib.sha256(evil).hexdigest(),
    }
    _refused(forged, marker, "signature does not match")
    _refused({**ref, "ref": f"file://{planted}"}, marker, "signature does not match")


def test_an_envelope_replayed_from_another_run_is_refused_when_the_caller_asks(tmp_path, marker):
    other_run = json.loads(json.dumps(to_xcom((1, 2), tmp_path)))  # from run manual__1
    assert output_origin(other_run)["run_id"] == "manual__1"
    _refused(
        other_run, marker, "run_id='manual__1', not the expected 'manual__2'", expect={"run_id": "manual__2"}
    )
    # Its origin cannot be rewritten either: the signature covers it.
    moved = {**other_run, "origin": {**other_run["origin"], "run_id": "manual__2"}}
    _refused(moved, marker, "signature does not match", expect={"run_id": "manual__2"})


# -- the key file -----------------------------------------------------------------------------------


@pytest.fixture
def key_home(monkeypatch, tmp_path) -> Path:
    monkeypatch.delenv("AIRFLOW__TORCHDIST__OUTPUT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    return tmp_path / signing.KEY_FILE


def test_a_key_file_others_can_read_is_refused(key_home):
    key_home.write_text("k" * 64)
    os.chmod(key_home, 0o644)
    with pytest.raises(SigningKeyError, match="mode 0600.*mode 0644.*chmod 600"):
        signing.signing_key()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_key_file_of_another_user_is_refused(key_home):
    key_home.write_text("k" * 64)
    os.chmod(key_home, 0o600)
    os.chown(key_home, 12345, -1)
    with pytest.raises(SigningKeyError, match="owned by uid 12345"):
        signing.signing_key()


def test_a_short_or_empty_key_file_is_refused(key_home):
    for content in ("", "abc"):
        key_home.write_text(content)
        os.chmod(key_home, 0o600)
        with pytest.raises(SigningKeyError, match="needs at least 32"):
            signing.signing_key()


def test_a_symlinked_key_file_is_refused(key_home, tmp_path):
    target = tmp_path / "elsewhere.key"
    target.write_text("k" * 64)
    os.chmod(target, 0o600)
    key_home.symlink_to(target)
    with pytest.raises(SigningKeyError, match="symlink"):
        signing.signing_key()


def test_concurrent_first_uses_all_read_one_complete_key(key_home):
    keys: list[bytes] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            keys.append(signing.signing_key())
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(keys)) == 1 and len(keys[0]) == 64
    assert stat.S_IMODE(key_home.stat().st_mode) == 0o600
    assert [p.name for p in key_home.parent.iterdir()] == [signing.KEY_FILE]
