"""Where a lifeline listens: a TCP host and port, or, for a run whose owners are all on its machine,
an ``AF_UNIX`` socket in the run's private staging directory, written ``unix:<path>`` where a host
goes (its port 0), so that records, trigger kwargs and both clients carry it as they carry a host.

A local socket is one that other users of the machine cannot even connect to: the staging directory
is this user's and 0700. So an owner connects to one only while that holds
(:func:`check_private_socket`): a record naming a socket anywhere else (whoever may edit a task's
state can write a record) is refused, saying why. Both ends also check the other's user on the
socket itself (``SO_PEERCRED``, where the system has it). Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import stat
import struct
import sys
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.supervision.lifeline.messages import LifelineError

UNIX_PREFIX = "unix:"
#: The socket's name in the staging directory.
SOCKET_NAME = "lifeline.sock"
#: The longest socket path the kernel takes: ``sun_path`` holds 108 bytes on Linux, 104 on macOS
#: and the BSDs, its terminating NUL included.
MAX_UNIX_PATH_BYTES = (108 if sys.platform.startswith("linux") else 104) - 1


class UnsafeLifelineSocket(LifelineError):
    """A record names a local lifeline socket that is not in a private directory of this user."""


def unix_host(path: str | os.PathLike[str]) -> str:
    """The ``host`` that names the local socket at ``path``."""
    return UNIX_PREFIX + os.fspath(path)


def unix_path(host: str) -> str | None:
    """The socket path a ``unix:`` host names; None for a TCP host."""
    return host[len(UNIX_PREFIX) :] if host.startswith(UNIX_PREFIX) else None


def where(host: str, port: int) -> str:
    """An address as messages show it: ``host:port``, or the ``unix:`` host alone."""
    return host if unix_path(host) is not None else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_socket_path(staging_dir: Path) -> str | None:
    """Where a local lifeline listens in ``staging_dir``; None when the path is over the kernel's
    limit (a staging directory under a long ``TMPDIR``), for the caller to fall back to TCP."""
    path = os.path.abspath(staging_dir / SOCKET_NAME)
    return path if len(os.fsencode(path)) <= MAX_UNIX_PATH_BYTES else None


def lifeline_bind(bind_host: str, staging_dir: Path) -> tuple[str, str | None]:
    """Where a run's lifeline listens, for ``[torchdist] lifeline_host`` = ``bind_host``, and what
    the supervisor's log says when it falls back.

    A loopback host means all owners are on this machine: a unix socket in the staging directory
    (0700: other users cannot even connect). TCP on ``bind_host`` (said) when that path is over the
    kernel's limit or the directory is not one owners accept (:func:`check_private_socket`); TCP
    for any other host."""
    if not is_loopback(bind_host):
        return bind_host, None
    path = local_socket_path(staging_dir)
    try:
        if path is None:
            raise UnsafeLifelineSocket(
                f"the staging directory {staging_dir} is too deep for a unix socket (at most "
                f"{MAX_UNIX_PATH_BYTES} bytes)"
            )
        _check_private_directory(path)
    except (UnsafeLifelineSocket, OSError) as exc:
        return bind_host, (
            f"{exc}: the lifeline listens on TCP {bind_host} instead, where other users of this machine "
            "can connect (and are refused). A shorter TMPDIR, or the operator's staging_dir, under "
            "directories only this user or root can write, keeps it private."
        )
    return unix_host(path), None


def _gone(path: str, why: str) -> ConnectionRefusedError:
    # What the clients take for "the run is gone" (its staging directory went with its teardown).
    return ConnectionRefusedError(f"no lifeline socket at {path}: {why}")


def check_private_socket(path: str) -> None:
    """Refuse (:class:`UnsafeLifelineSocket`) a socket path that is not this user's socket in a
    directory of this user's that only it may use (0700, no symlink), under directories that
    nobody else can rename it in (owned by this user or root, not writable by others unless
    sticky, as ``/tmp``). A path that is not there raises :class:`ConnectionRefusedError`."""
    uid = os.getuid()
    try:
        _check_private_directory(path)
    except FileNotFoundError:
        raise _gone(path, "its directory is gone") from None
    try:
        sock_info = os.lstat(path)
    except FileNotFoundError:
        raise _gone(path, "the supervisor is not listening") from None
    if not stat.S_ISSOCK(sock_info.st_mode) or sock_info.st_uid != uid:
        raise UnsafeLifelineSocket(f"{path} is not a socket of this user (uid {uid}): not a lifeline")


def _check_private_directory(path: str) -> None:
    """The directory part of :func:`check_private_socket` (``path``: the socket's)."""
    uid = os.getuid()
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise UnsafeLifelineSocket(f"the lifeline socket path {path!r} is not an absolute, normal path")
    parent = os.path.dirname(path)
    info = os.lstat(parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise UnsafeLifelineSocket(
            f"the lifeline socket {path} is not in a private directory: {parent} is "
            f"{'a directory' if stat.S_ISDIR(info.st_mode) else 'not a directory'} of uid {info.st_uid} "
            f"with mode {stat.S_IMODE(info.st_mode):o}; a local lifeline is used only in a directory of this "
            f"user (uid {uid}) with mode 700, the run's staging directory. The record does not come from "
            "this deployment's supervisor: clear the task's state (task_state_store key 'torchdist_run')."
        )
    ancestor = os.path.dirname(parent)
    while True:
        above = os.stat(ancestor)
        others_write = above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, uid) or others_write:
            raise UnsafeLifelineSocket(
                f"the lifeline socket {path} lies under {ancestor} (uid {above.st_uid}, mode "
                f"{stat.S_IMODE(above.st_mode):o}), where another user could swap its directory; "
                "a staging directory must lie under directories of this user or root that others cannot write"
            )
        if ancestor == os.path.dirname(ancestor):
            break
        ancestor = os.path.dirname(ancestor)


def listen_lifeline(bind_host: str) -> tuple[socket.socket, tuple[str, int]]:
    """A listening socket on ``bind_host`` (a free port), or on the ``unix:`` path it names, with
    the address owners connect to."""
    path = unix_path(bind_host)
    if path is None:
        family = socket.getaddrinfo(bind_host, 0, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((bind_host, 0), family=family)
        return sock, sock.getsockname()[:2]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by a supervisor of this staging directory that died
        sock.bind(path)
        os.chmod(path, 0o600)  # its directory (0700) is what keeps others out; this says it too
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock, (unix_host(path), 0)


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process at the other end of a local socket; None where the system
    does not say (no ``SO_PEERCRED``)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock.family != socket.AF_UNIX:
        return None
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return pid, uid


def slot_source(address: str) -> str:
    """Whom a TCP peer at ``address`` counts as for the handshake slots (:mod:`.slots`): its IPv4
    address (an IPv4-mapped IPv6 one too), the /64 of an IPv6 one (one host may use the whole
    /64), and ``loopback`` for all of 127.0.0.0/8 and ``::1`` (one machine, any of whose users
    may bind any loopback address)."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # a link-local address's %zone
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def peer_source(conn: socket.socket, peer: Any) -> tuple[str | None, str]:
    """Whom an accepted connection's handshake slot counts against (:func:`slot_source`), and how
    the log names it; None for a local peer of this user, "" for one of another user."""
    if conn.family != socket.AF_UNIX:
        return slot_source(peer[0]), f"{peer[0]}:{peer[1]}"
    credentials = peer_credentials(conn)
    if credentials is None:
        return None, "a local process"
    pid, uid = credentials
    return (None if uid == os.getuid() else ""), f"pid {pid}"


def _check_listener(sock: socket.socket, path: str) -> None:
    credentials = peer_credentials(sock)
    if credentials is not None and credentials[1] != os.getuid():
        raise UnsafeLifelineSocket(
            f"the process listening on {path} (pid {credentials[0]}) runs as uid {credentials[1]}, "
            f"not as this user (uid {os.getuid()}): not this deployment's supervisor"
        )


def open_lifeline(host: str, port: int, timeout: float) -> socket.socket:
    """A connected socket to the lifeline at ``host`` (TCP, or a checked ``unix:`` socket).

    Raises :class:`OSError` as connecting does (:class:`ConnectionRefusedError` when nothing is
    there), :class:`UnsafeLifelineSocket` for a socket outside a private directory."""
    path = unix_path(host)
    if path is None:
        return socket.create_connection((host, port), timeout=timeout)
    check_private_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise _gone(path, "the supervisor is not listening") from None
        _check_listener(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


async def open_lifeline_async(
    host: str, port: int, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """:func:`open_lifeline` on asyncio streams (the caller bounds the time it takes)."""
    path = unix_path(host)
    if path is None:
        return await asyncio.open_connection(host, port, limit=limit)
    check_private_socket(path)  # a few lstat calls of local directories: not worth a thread
    try:
        reader, writer = await asyncio.open_unix_connection(path, limit=limit)
    except FileNotFoundError:
        raise _gone(path, "the supervisor is not listening") from None
    try:
        _check_listener(writer.get_extra_info("socket"), path)
    except BaseException:
        writer.close()
        raise
    return reader, writer
