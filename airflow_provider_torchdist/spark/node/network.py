"""Addresses and interfaces on the host a task runs on."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of a network interface, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_for_address(address: str) -> str | None:
    """The name of the interface that carries ``address`` (``lo`` for 127.0.0.1), if any.

    gloo and NCCL pick their interface from the machine's hostname, which on a multi-homed or
    containerised host often resolves to loopback; the interface that carries the executor's
    address is the one its peers can reach.
    """
    try:
        wanted = socket.gethostbyname(address)
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == wanted:
            return name
    return None


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (bound, read and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s address only, not on every interface; ``port`` 0: any.

    ``host`` is an IP address or a name; a name is resolved here and its first address is used, the
    one a client on this machine would try first. Raises OSError when that address is not this
    machine's (``EADDRNOTAVAIL``) or the port is taken.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        s.listen(socket.SOMAXCONN)
    except OSError:
        s.close()
        raise
    return s


def is_loopback_name(host: str) -> bool:
    """Whether ``host`` is a name (not an address) that resolves to loopback on this machine.

    The Debian-style ``127.0.1.1 myhost`` line in /etc/hosts does that: peers resolve the same name
    to the machine's real address, so a server bound to what it resolves to here would be unreachable.
    """
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP ``connect``: no packet is sent)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]
