"""Following a run from the Airflow side, as its owner: its log lines, application and metrics.

The driver serves them on its run channel to whoever holds the run's owner token
(:mod:`~airflow_provider_torchdist.spark.driver.owner`); the hook writes the token into the staging
directory before spark-submit starts and the driver writes the channel's address beside it. The
follower waits for that address, connects, and hands every event to its callbacks until the driver
closes the channel: no line of the task log comes from scraping spark-submit's output.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_torchdist.spark.driver.owner import OwnerClient, read_channel_address
from airflow_provider_torchdist.spark.wire.channel_auth import ChannelRefused
from airflow_provider_torchdist.spark.wire.protocol import Application, LogLine, Metric


class RunFollower:
    """A thread that follows one run as its owner (see the module docstring).

    Example::

        follower = RunFollower(staging_dir, token, on_line=log.info, on_application=..., on_metric=...)
        follower.start()
        ...  # spark-submit runs
        follower.stop()
    """

    def __init__(
        self,
        staging_dir: Path,
        owner_token: str,
        *,
        on_line: Callable[[str], None],
        on_application: Callable[[str, str | None, str | None], None],
        on_metric: Callable[[dict[str, Any]], None],
    ) -> None:
        self._dir = staging_dir
        self._token = owner_token
        self._on_line, self._on_application, self._on_metric = on_line, on_application, on_metric
        self._stopping = threading.Event()
        self._client: OwnerClient | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._follow, name="torchdist-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _follow(self) -> None:
        address = None
        while address is None:  # the driver writes it once its channel listens
            address = read_channel_address(self._dir)
            if address is None and self._stopping.wait(0.02):
                return
        try:
            client = OwnerClient(address, self._token)
        except (ChannelRefused, OSError) as exc:
            self._on_line(f"[torchdist] cannot follow the run's log: {exc}")
            return
        with self._lock:
            if self._stopping.is_set():
                client.close()
                return
            self._client = client
        for event in client.events():
            if isinstance(event, LogLine):
                self._on_line(event.text)
            elif isinstance(event, Application):
                self._on_application(event.app_id, event.ui_url, event.operation)
            elif isinstance(event, Metric):
                self._on_metric(event.record)

    def stop(self, timeout: float = 5.0) -> None:
        """After spark-submit ended: let the last events in (the driver has closed the channel), then stop."""
        with self._lock:
            following = self._client is not None
        if following:  # the driver's exit closed the channel: the stream ends by itself
            self._thread.join(timeout)
        self._stopping.set()
        with self._lock, contextlib.suppress(OSError):
            if self._client is not None:
                self._client.close()
        self._thread.join(timeout)
