"""Rank 0's value on its way out: how it is encoded, and how the driver keeps it for the Airflow side.

Rank 0 decides the encoding, because only it holds the value: a JSON-native value (None, bool,
int, finite float, str, lists and str-keyed dicts of them) is written as JSON, anything else as a
pickle. The Airflow worker then never has to unpickle bytes to find out which it got: it reads the
driver's manifest, parses JSON with a JSON parser, and signs a pickle without loading it.

The driver accepts one output per worker-group generation from the connection it verified as
global rank 0 (:mod:`~airflow_provider_torchdist.spark.wire.channel_auth`), publishes it as
``output.pkl`` with an atomic rename, and writes the manifest beside it. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE

FORMAT_JSON = "json"
FORMAT_PICKLE = "cloudpickle"
FORMATS = (FORMAT_JSON, FORMAT_PICKLE)
#: Beside ``output.pkl``: the :class:`OutputManifest` the driver wrote for it.
MANIFEST_SUFFIX = ".manifest.json"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TYPE_NAME = re.compile(r"[A-Za-z_][\w.<>]{0,199}")


def is_json_native(value: Any) -> bool:
    """True when XCom's JSON round trip gives back an equal value of the same types."""
    # Exact types: a subclass (an IntEnum, say) would come back from JSON as its base type.
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(is_json_native(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) for k in value) and all(is_json_native(v) for v in value.values())
    return False


def encode_json(value: Any) -> bytes:
    """The JSON bytes of a JSON-native value (compact, ASCII, no NaN)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")


def decode_json(data: bytes) -> Any:
    """Parse JSON output bytes, refusing ``NaN``/``Infinity``, which rank 0 never writes."""

    def refuse(token: str) -> Any:
        raise ValueError(f"non-finite number {token} in a JSON output")

    return json.loads(data, parse_constant=refuse)


def type_name(value: Any) -> str:
    """``torch.Tensor``, ``tuple``: the value's type, for people reading XCom in the UI."""
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")[:200]


@dataclass(frozen=True)
class OutputManifest:
    """What the driver knows of the output file beside it; it vouches for that file only.

    ``size``, ``ino`` and ``mtime_ns`` tie it to the file it was written for: a manifest whose file
    changed since is not that file's manifest.
    """

    format: str
    type: str
    size: int
    sha256: str
    ino: int
    mtime_ns: int
    #: The worker-group generation (torchrun restart, Spark stage attempt) that produced it.
    generation: str

    @classmethod
    def read(cls, output: Path) -> OutputManifest | None:
        """The manifest of ``output``, or None when there is none, it is malformed, or the file changed."""
        try:
            data = json.loads(output.with_name(output.name + MANIFEST_SUFFIX).read_text())
            st = output.stat()
            manifest = cls(**data)
        except (OSError, ValueError, TypeError):
            return None
        if not manifest.valid() or (manifest.size, manifest.ino, manifest.mtime_ns) != (
            st.st_size,
            st.st_ino,
            st.st_mtime_ns,
        ):
            return None
        return manifest

    def valid(self) -> bool:
        ints = (self.size, self.ino, self.mtime_ns)
        return (
            self.format in FORMATS
            and isinstance(self.type, str)
            and bool(_TYPE_NAME.fullmatch(self.type))
            and all(type(n) is int and n >= 0 for n in ints)
            and isinstance(self.sha256, str)
            and bool(_HEX64.fullmatch(self.sha256))
            and isinstance(self.generation, str)
        )


def publish_output(
    part: Path, output_dir: Path, *, format: str, type: str, sha256: str, generation: str
) -> Path:
    """Make the complete file at ``part`` the run's output, atomically, with its manifest.

    Only the driver calls this, for the one output it accepted in a generation; a later
    generation's output replaces an earlier one's.
    """
    final = output_dir / OUTPUT_FILE
    manifest_file = final.with_name(OUTPUT_FILE + MANIFEST_SUFFIX)
    manifest_file.unlink(missing_ok=True)  # never a moment where the old manifest meets the new file
    os.replace(part, final)
    st = final.stat()
    manifest = OutputManifest(
        format=format,
        type=type,
        size=st.st_size,
        sha256=sha256,
        ino=st.st_ino,
        mtime_ns=st.st_mtime_ns,
        generation=generation,
    )
    if not manifest.valid():
        final.unlink(missing_ok=True)
        raise ValueError(f"rank 0's output description is malformed: {manifest}")
    tmp = manifest_file.with_name(f".{manifest_file.name}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(manifest), f)
    os.replace(tmp, manifest_file)
    return final


#: A worker-group generation: (the node's registration attempt, torchrun's restart count).
Generation = tuple[int, int]
_IN_PLACE_NAME = re.compile(r"\.torchdist-output-[A-Za-z0-9_]{1,64}\.pkl")


class OutputLedger:
    """The driver's rule for rank 0's value: exactly one output per generation, the newest one kept.

    Socket-free: the channel calls it for the connection it verified as global rank 0.
    """

    def __init__(self, output_dir: Path) -> None:
        self._dir = output_dir
        self._lock = threading.Lock()
        self._claimed: set[Generation] = set()
        self._published: Generation | None = None

    def claim(self, generation: Generation) -> None:
        """Reserve ``generation``'s one output; a second claim for it is refused."""
        with self._lock:
            if generation in self._claimed:
                raise ValueError(
                    f"a second output for worker-group generation {generation} was refused: rank 0 "
                    "sends its value once"
                )
            self._claimed.add(generation)

    def publish(self, part: Path, generation: Generation, *, format: Any, type: Any, sha256: Any) -> None:
        """Publish a complete file, unless a newer generation's output is already there."""
        with self._lock:
            if self._published is not None and generation < self._published:
                part.unlink(missing_ok=True)
                return
            publish_output(
                part,
                self._dir,
                format=format,
                type=type,
                sha256=sha256,
                generation=f"{generation[0]}.{generation[1]}",
            )
            self._published = generation

    def publish_in_place(self, name: str, generation: Generation, **meta: Any) -> None:
        """Rank 0 on the driver's machine wrote its file into the output dir itself: take that file."""
        if not _IN_PLACE_NAME.fullmatch(name):
            raise ValueError(f"bad output file name {name!r}")
        part = self._dir / name
        st = os.lstat(part)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"rank 0's output {name!r} is not a regular file")
        self.publish(part, generation, **meta)


def read_output(path: Path | None) -> Any:
    """Decode the output file at ``path`` by its manifest (None for no output: a script).

    Unpickles a pickle: only for a caller that ran the training itself (``hook.run()``).
    """
    if path is None:
        return None
    manifest = OutputManifest.read(path)
    if manifest is None:
        raise RuntimeError(f"rank 0's output at {path} has no valid manifest from the driver; it is not used")
    if manifest.format == FORMAT_JSON:
        return decode_json(path.read_bytes())
    import cloudpickle

    with open(path, "rb") as f:
        return cloudpickle.load(f)
