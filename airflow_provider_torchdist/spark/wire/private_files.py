"""Private files written whole: the one atomic, owner-only write both sides use.

The hook's properties file, the supervisor's settings and address, the owner token and the driver's
channel address are all written this way; and the private directories of a node's processes
(:func:`private_directory`). Standard library only: the Spark side imports it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
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


#: A torchrun agent's log directory (:mod:`~airflow_provider_torchdist.spark.node.launcher`).
AGENT_DIR_PREFIX = "torchdist-agent-"
#: A node's ``train_data`` shards (:mod:`~airflow_provider_torchdist.spark.data.shard_files`).
DATA_DIR_PREFIX = "torchdist-data-"
#: A Connect node's payload (:mod:`~airflow_provider_torchdist.spark.connect.node_task`).
CONNECT_DIR_PREFIX = "torchdist-connect-"
#: A rank's staging of the sharded checkpoint it saves, and its fetch of the one it restores
#: (:mod:`~airflow_provider_torchdist.spark.node.sharded_checkpoints`): a whole model's shards.
CHECKPOINT_STAGING_PREFIX = "torchdist-staging-"
CHECKPOINT_RESTORE_PREFIX = "torchdist-sharded-"
#: Every prefix :func:`private_directory` is given: the Airflow worker's sweep knows them all.
NODE_DIR_PREFIXES = (
    AGENT_DIR_PREFIX,
    DATA_DIR_PREFIX,
    CONNECT_DIR_PREFIX,
    CHECKPOINT_STAGING_PREFIX,
    CHECKPOINT_RESTORE_PREFIX,
)


def private_directory(prefix: str) -> str:
    """A new private directory (0700) in the temp directory, ``<prefix><pid>-<random>``, made after
    removing those of this user's processes that are dead. A process killed before it removed its
    directory leaves it (Spark kills a cancelled task's Python worker with SIGKILL, so no ``finally``
    runs): the next one on this machine removes it. Only real directories of this user whose name
    holds a PID that no process has are removed."""
    named = re.compile(re.escape(prefix) + r"(\d+)-.+")
    base = Path(tempfile.gettempdir())
    for entry in base.glob(f"{prefix}*"):
        match = named.fullmatch(entry.name)
        if match is None:
            continue
        try:
            # One lstat: a live process may remove its own directory between the listing and here.
            info = entry.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not _alive(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def _alive(pid: int) -> bool:
    """Whether a process may have ``pid``: one not ours to signal, or a number past the PID range,
    counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        pass  # not ours to signal, or a number no PID can be: leave its directory alone
    return True
