"""The per-user cache of driver JVM class-data archives (:mod:`~airflow_provider_torchdist.submit.jvm`):
finding a complete archive, pruning stale ones, and a cache directory that is this user's alone."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

#: A dump left by a run that was killed before it could be installed or deleted.
STALE_DUMP_S = 24 * 3600
#: Archives of combinations not written for this long (older JDK or Spark installs) are deleted.
STALE_ARCHIVE_S = 30 * 24 * 3600
#: The option parser of Spark's launcher splits on whitespace and quotes, and ``-Xlog`` on ``:``
#: and ``,``; a cache path with none of those needs no quoting anywhere.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._/+@=~-]+$")


def find_archive(cache: Path, key: str) -> Path | None:
    """This key's complete archive, if the cache has one: ``<key>-<size>.jsa`` whose size matches.

    A truncated archive would crash the JVM (it maps the file: SIGBUS), so a file whose size is not
    the one it was installed with is never handed to it.
    """
    try:
        names = os.listdir(cache)
    except OSError:
        return None
    prefix = f"{key}-"
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".jsa")):
            continue
        size = name[len(prefix) : -len(".jsa")]
        path = cache / name
        try:
            st = os.stat(path)
        except OSError:
            continue
        if size.isdigit() and st.st_size == int(size) and st.st_uid == os.geteuid():
            return path
    return None


def prune_cache(cache: Path, keep: Path | None = None, now: float | None = None) -> None:
    """Delete dumps of killed runs (a day old) and other archives older than 30 days; never raises.

    ``keep`` (the archive this run uses) is never deleted, so an archive in use stays.
    """
    import time

    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(cache))
    except OSError:
        return
    for entry in entries:
        if keep is not None and entry.path == str(keep):
            continue
        if entry.name.endswith((".jsa.part", ".log")):
            limit = STALE_DUMP_S
        elif entry.name.endswith(".jsa"):
            limit = STALE_ARCHIVE_S
        else:
            continue
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > limit:
                os.unlink(entry.path)


def private_cache_dir(cache: Path) -> Path | None:
    """Create ``cache`` (0700) if needed; None when it is not ours alone or its path needs quoting.

    The JVM maps the archive as code, so a directory another user can write to is not used.
    """
    if not _SAFE_PATH.match(str(cache)):
        return None
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(cache)
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return cache
