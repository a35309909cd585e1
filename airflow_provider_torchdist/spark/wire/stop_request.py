"""The stop request: how whoever stops a run asks its driver for a graceful stop.

The stopper (the run's supervisor tearing it down) writes ``<staging>/stop-request.json``, the
:class:`~airflow_provider_torchdist.spark.wire.protocol.StopRequest` as the wire encodes it
(``{"k": "stop", "reason": "timeout", "grace": 30.0}``, atomic, 0600), with :func:`write_stop_request`; the driver's run channel polls for it
(:func:`read_stop_request`) and sends every rank a
:class:`~airflow_provider_torchdist.spark.wire.protocol.StopRequest`. Each rank answers whether its code
watches for stops; when none does, the driver writes ``stop-declined`` beside the request, and the
stopper kills the run at once instead of waiting out a grace period that would save nothing.
The staging directory is the one both already share (the owner token and the channel address travel through it too), so
a stop needs no new port and works whether or not anyone follows the run yet.

Standard library only: the driver imports it.
"""

from __future__ import annotations

from pathlib import Path

from airflow_provider_torchdist.spark.wire.private_files import write_private_bytes, write_private_text
from airflow_provider_torchdist.spark.wire.protocol import STOP_REASON_CHARS, StopRequest, decode, encode

STOP_REQUEST_FILE = "stop-request.json"
#: The reason of the driver's own stop when Spark decommissions an executor running a node
#: (``spark.decommission.enabled``): in an elastic run the ranks then wait, after their
#: checkpoint, for the group to meet again without that node (:mod:`~airflow_provider_torchdist.spark.node.rank`).
DECOMMISSIONED = "node decommissioned"
#: Written by the driver when every rank answered that its code does not watch for stops: the
#: stopper need not wait out the grace period.
STOP_DECLINED_FILE = "stop-declined"


def write_stop_request(staging_dir: str | Path, reason: str, grace: float) -> Path:
    """Ask the run's driver to stop its ranks, giving them ``grace`` seconds to checkpoint."""
    request = encode(StopRequest(reason[:STOP_REASON_CHARS], float(grace)))
    return write_private_bytes(Path(staging_dir) / STOP_REQUEST_FILE, request)


def read_stop_request(staging_dir: str | Path) -> StopRequest | None:
    """The stop asked for, or None: none yet, or a file that is not one (the wire's own checks; it
    is then ignored, and the hard stop that follows the grace period still comes)."""
    try:
        request = decode((Path(staging_dir) / STOP_REQUEST_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return request if isinstance(request, StopRequest) else None


def write_stop_declined(staging_dir: str | Path, ranks: int) -> Path:
    """The driver's side: none of the run's ``ranks`` ranks watches for stops (see :data:`STOP_DECLINED_FILE`)."""
    return write_private_text(Path(staging_dir) / STOP_DECLINED_FILE, f"{ranks}\n")


def stop_declined(staging_dir: str | Path) -> bool:
    """The stopper's side: whether the driver said that no rank watches for stops."""
    return (Path(staging_dir) / STOP_DECLINED_FILE).exists()
