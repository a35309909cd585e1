"""The per-user cache of driver JVM class-data archives (:mod:`~airflow_provider_torchdist.submit.jvm`):
finding a complete archive, pruning stale ones, and a cache directory that is this user's alone."""

from __future__ import annotations

import contextlib
import os
import re
import stat
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
    """Create ``cache`` (0700, with any missing parent) if needed; None when it is not ours alone,
    when a directory above it could be swapped by another user, or when its path needs quoting.

    The JVM maps the archive as code, so a directory another user can write to is not used, nor
    one below a directory in which another user could rename it away and put their own in its
    place: every directory from ``/`` down, as written and with symlinks resolved, must be this
    user's or root's and not writable by others unless sticky (as ``/tmp``).
    """
    if not _SAFE_PATH.match(str(cache)):
        return None
    try:
        _make_private_dirs(cache)
        st = os.stat(cache)
        chain_is_safe = _no_one_else_can_swap(cache)
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not chain_is_safe:
        return None
    return cache


def _make_private_dirs(cache: Path) -> None:
    """``mkdir -p`` with every directory made 0700 (``Path.mkdir(parents=True)`` gives the parents
    the umask's mode, group-writable under a umask of 002)."""
    missing = []
    while not os.path.lexists(cache) and cache != cache.parent:
        missing.append(cache)
        cache = cache.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by a racing run: checked like any other
            directory.mkdir(mode=0o700)


def _no_one_else_can_swap(cache: Path) -> bool:
    """Whether every directory (and symlink) on the way to ``cache`` is this user's or root's, and
    no directory is writable by others unless sticky (where only an entry's owner may rename it).

    The path as written is walked with ``lstat`` (a link can be replaced by its owner or by who can
    write its directory), then the resolved path, where the links lead."""
    uid = os.geteuid()
    for path in (os.path.abspath(cache), os.path.realpath(cache)):
        while True:
            st = os.lstat(path)
            if st.st_uid not in (0, uid):
                return False
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return False
            if path == os.path.dirname(path):
                break
            path = os.path.dirname(path)
    return True
