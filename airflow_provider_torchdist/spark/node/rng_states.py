"""The random number generators a rank's training draws from, saved with every checkpoint and
restored on load (:mod:`~airflow_provider_torchdist.spark.node.resume_position`): torch's (CPU,
and CUDA's when this process has started CUDA), NumPy's global generator and Python's ``random``.

A state is a plain JSON value (bytes as base64) and is read back from a store every executor of
the run can write, so :func:`checked_rng` checks it field by field (types, sizes, ranges) before
anything is set: nothing in it is unpickled or evaluated. Imports torch and NumPy only when called.
"""

from __future__ import annotations

import base64
import binascii
import random
from dataclasses import dataclass
from typing import Any

#: MT19937's state: 624 words and a position (Python's ``random`` keeps the position as a 625th).
MT_WORDS = 624
#: The most CUDA devices a state is accepted for, and the most bytes of one device's state
#: (torch's Philox state is 16).
MAX_CUDA_DEVICES = 64
MAX_CUDA_STATE_BYTES = 64


@dataclass(frozen=True)
class RngStates:
    """Checked states, ready to set (:func:`restore_rng`)."""

    python: tuple[Any, ...]
    torch_cpu: bytes
    numpy: tuple[Any, ...] | None
    cuda: list[bytes] | None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def capture_rng() -> dict[str, Any]:
    """This process's generator states, as a JSON-able dict (what :func:`checked_rng` reads)."""
    import torch

    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": None,
        "cuda": None,
    }
    try:
        import numpy as np
    except ImportError:  # torch runs without NumPy; then there is no generator of its to save
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        if kind == "MT19937":
            states["numpy"] = {
                "keys": _b64(keys.astype("<u4").tobytes()),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
    # Only once CUDA is started: asking would start it (and take a GPU's memory) in a CPU rank.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return states


def _int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {_short(value)}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {_short(value)}")
    return float(value)


def _bytes(value: Any, size: int | None, most: int, what: str) -> bytes:
    """Base64 ``value`` decoded: exactly ``size`` bytes (or at most ``most`` when ``size`` is None)."""
    if not isinstance(value, str) or len(value) > (most * 4) // 3 + 4:
        raise ValueError(f"{what} must be a base64 string of at most {most} bytes, got {_short(value)}")
    try:
        data = base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{what} is not base64: {exc}") from None
    if (size is not None and len(data) != size) or len(data) > most:
        raise ValueError(f"{what} holds {len(data)} bytes, not {size if size is not None else f'<= {most}'}")
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dict(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not keys <= set(value):
        raise ValueError(f"{what} must be an object with {sorted(keys)}, got {_short(value)}")
    return value


def checked_rng(data: Any) -> RngStates:
    """``data`` (what :func:`capture_rng` wrote) checked field by field; ``ValueError`` naming the
    first field that is not what a real state holds."""
    import torch

    data = _dict(data, {"python", "torch", "numpy", "cuda"}, "rng")
    py = _dict(data["python"], {"version", "internal", "gauss_next"}, "rng.python")
    internal = py["internal"]
    if not isinstance(internal, list) or len(internal) != MT_WORDS + 1:
        raise ValueError(f"rng.python.internal must be a list of {MT_WORDS + 1} integers")
    words = tuple(_int(w, 0, 2**32 - 1, "rng.python.internal[...]") for w in internal[:-1])
    position = _int(internal[-1], 0, MT_WORDS, "rng.python.internal[-1]")
    gauss = py["gauss_next"]
    python = (
        _int(py["version"], 3, 3, "rng.python.version"),
        (*words, position),
        None if gauss is None else _float(gauss, "rng.python.gauss_next"),
    )
    cpu_size = torch.get_rng_state().numel()
    torch_cpu = _bytes(data["torch"], cpu_size, cpu_size, "rng.torch")
    numpy = None
    if data["numpy"] is not None:
        np_state = _dict(data["numpy"], {"keys", "pos", "has_gauss", "cached_gaussian"}, "rng.numpy")
        numpy = (
            "MT19937",
            _bytes(np_state["keys"], MT_WORDS * 4, MT_WORDS * 4, "rng.numpy.keys"),
            _int(np_state["pos"], 0, MT_WORDS, "rng.numpy.pos"),
            _int(np_state["has_gauss"], 0, 1, "rng.numpy.has_gauss"),
            _float(np_state["cached_gaussian"], "rng.numpy.cached_gaussian"),
        )
    cuda = data["cuda"]
    if cuda is not None:
        if not isinstance(cuda, list) or len(cuda) > MAX_CUDA_DEVICES:
            raise ValueError(f"rng.cuda must be a list of at most {MAX_CUDA_DEVICES} states")
        cuda = [_bytes(s, None, MAX_CUDA_STATE_BYTES, "rng.cuda[...]") for s in cuda]
    return RngStates(python, torch_cpu, numpy, cuda)


def restore_rng(states: RngStates) -> str | None:
    """Set this process's generators to ``states``; returns why CUDA's were not set (a different
    number of devices, or no CUDA here), or None."""
    import torch

    random.setstate(states.python)
    torch.set_rng_state(torch.frombuffer(bytearray(states.torch_cpu), dtype=torch.uint8))
    if states.numpy is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = states.numpy
        np.random.set_state(
            (kind, np.frombuffer(keys, dtype="<u4").astype(np.uint32), pos, has_gauss, cached)
        )
    if states.cuda is None:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(states.cuda):
        return f"CUDA's generators were saved for {len(states.cuda)} device(s) and are not set here"
    torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in states.cuda])
    return None
