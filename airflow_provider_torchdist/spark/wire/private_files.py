"""Private files written whole: the one atomic, owner-only write both sides use.

The hook's properties file, the supervisor's settings and address, the owner token and the driver's
channel address are all written this way. Standard library only: the Spark side imports it too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_private_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` as :func:`write_private_bytes` does."""
    return write_private_bytes(path, text.encode(encoding))


def write_private_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` in a file only its owner can read: created 0600 under a temporary
    name beside it, then renamed over whatever was there, so no reader sees half a file. Returns
    the path written."""
    target = Path(path)
    fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise
    return target
