"""The current rank's connection to the driver, for code that runs inside a rank.

:func:`~airflow_provider_torchdist.spark.node.rank.run_rank` sets it once the rank has connected;
:func:`~airflow_provider_torchdist.spark.node.metrics.report` reads it. Both import this module, and it
imports nothing of theirs, so neither needs the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_provider_torchdist.spark.node.channel_client import ChannelClient

_client: ChannelClient | None = None


def set_client(client: ChannelClient | None) -> None:
    """Make ``client`` this process's connection to the driver (None: there is none)."""
    global _client
    _client = client


def get_client() -> ChannelClient | None:
    """This rank's connection to the driver; None outside a run or when the rank could not connect."""
    return _client
