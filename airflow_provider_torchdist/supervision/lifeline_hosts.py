"""Where this deployment's supervisors listen, and which addresses its owners and its Training view
connect to: the lifeline host allow-list.

A run's address comes from its record in ``task_state_store``, which Airflow 3.3 lets the UI and
the REST API edit. Whoever can edit it must not make the task, a trigger, a retry or the API server
connect where they like (and hand a supervisor-to-be the run's stream): every one of them checks the
record's host with :func:`check_lifeline_address` (the view with :func:`lifeline_address_allowed`)
before it connects. The allowed hosts are ``[torchdist] lifeline_host`` (where this deployment's
supervisors listen, 127.0.0.1 by default) and the comma-separated ``[torchdist] view_lifeline_hosts``
(workers on other machines, for triggerers and API servers elsewhere). A ``unix:`` address passes
here: the clients connect to a local socket only inside a private directory of this user
(:func:`~airflow_provider_torchdist.supervision.lifeline.address.check_private_socket`).

Example::

    check_lifeline_address(record.host, record.port)  # LifelineHostRefused for a host not allowed
"""

from __future__ import annotations

import ipaddress
import socket

from airflow_provider_torchdist.supervision.lifeline.address import unix_path
from airflow_provider_torchdist.supervision.lifeline.messages import LifelineError


class LifelineHostRefused(LifelineError):
    """A run record names a lifeline host outside this deployment's allow-list: nothing connects."""


def lifeline_host() -> str:
    """Where a supervisor listens for its owners: ``[torchdist] lifeline_host``, default 127.0.0.1.

    A deferred run's trigger connects from the triggerer: when that runs on another machine than
    the workers, set it to an address of the worker that the triggerer can reach."""
    from airflow.configuration import conf

    return conf.get("torchdist", "lifeline_host", fallback="127.0.0.1") or "127.0.0.1"


def lifeline_hosts() -> set[str]:
    """The allowed hosts: ``[torchdist] lifeline_host`` and ``[torchdist] view_lifeline_hosts``."""
    try:
        from airflow.configuration import conf

        extra = conf.get("torchdist", "view_lifeline_hosts", fallback="") or ""
    except Exception:  # no config to read: the default host only
        extra = ""
    return {lifeline_host(), *(h.strip() for h in extra.split(",") if h.strip())}


def _addresses(name: str) -> set[str]:
    """The IP addresses a configured host name stands for (none when it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def lifeline_address_allowed(host: str, allowed: set[str] | None = None) -> bool:
    """Whether an owner (or the view) may connect to a lifeline at ``host``: a host in ``allowed``
    (default :func:`lifeline_hosts`), an IP address a host name there resolves to (a supervisor
    records the address it bound, an IP), or a ``unix:`` socket (checked when connecting)."""
    if unix_path(host) is not None:
        return True
    allowed = lifeline_hosts() if allowed is None else allowed
    if host in allowed:
        return True
    # Names are resolved only when the plain comparison failed, and only for an IP in the record.
    return _is_ip(host) and any(host in _addresses(name) for name in allowed if not _is_ip(name))


def check_lifeline_address(host: str, port: int) -> None:
    """Refuse (:class:`LifelineHostRefused`) a run record's address outside the allow-list."""
    allowed = lifeline_hosts()
    if not lifeline_address_allowed(host, allowed):
        raise LifelineHostRefused(
            f"the run record names the lifeline address {host}:{port}, but {host!r} is not a lifeline host "
            f"of this deployment ({', '.join(sorted(allowed))}): nothing connects there. A run started "
            "by a worker on another machine: add that worker's address to [torchdist] view_lifeline_hosts "
            "(comma-separated) where this runs. Otherwise the task's state was edited: clear its "
            "task_state_store key 'torchdist_run'."
        )


__all__ = [
    "LifelineHostRefused",
    "check_lifeline_address",
    "lifeline_address_allowed",
    "lifeline_host",
    "lifeline_hosts",
]
