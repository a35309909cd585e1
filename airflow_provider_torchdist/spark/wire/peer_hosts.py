"""Which machine a connection comes from: the run channel's checks of a peer's address against
the host Spark's scheduler names. Standard library only."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any


def is_local_address(ip: str) -> bool:
    """True when ``ip`` belongs to this machine (loopback, or one of its interfaces)."""
    try:
        if ipaddress.ip_address(ip).is_loopback:
            return True
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except (ValueError, OSError):
        return False


def host_addresses(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address, as Spark reports it) stands for."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def peer_matches(peer_ip: str, host: str) -> bool:
    """Does a connection from ``peer_ip`` come from ``host``? An executor on the driver's own machine
    may reach the driver over loopback or any local address."""
    addresses = host_addresses(host)
    if peer_ip in addresses:
        return True
    return is_local_address(peer_ip) and any(is_local_address(a) for a in addresses)


def same_host(claimed: Any, host: str) -> bool:
    """Is ``claimed`` (what a node calls its own host, unchecked) a name of ``host``?"""
    if not isinstance(claimed, str) or not claimed or len(claimed) > 255:
        return False
    return any(peer_matches(ip, host) for ip in host_addresses(claimed))
