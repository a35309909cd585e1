"""Addresses and interfaces on the host a task runs on."""

from __future__ import annotations

import fcntl
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
