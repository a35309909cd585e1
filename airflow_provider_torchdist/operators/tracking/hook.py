"""``MlflowTrackingHook``: the ``mlflow`` connection type's hook (Airflow's connection form), and an
``MlflowClient`` for it in one call.

Example::

    client = MlflowTrackingHook("mlflow_default").get_client()
    client.search_runs([...])
"""

from __future__ import annotations

from typing import Any

from airflow.providers.common.compat.sdk import BaseHook

from airflow_provider_torchdist.operators.tracking.connection import CONN_TYPE, connect, load_target


class MlflowTrackingHook(BaseHook):
    """An MLflow tracking server, from a connection of type ``mlflow`` (see
    :mod:`~airflow_provider_torchdist.operators.tracking.connection` for its fields)."""

    conn_name_attr = "mlflow_conn_id"
    default_conn_name = "mlflow_default"
    conn_type = CONN_TYPE
    hook_name = "MLflow tracking server"

    def __init__(self, mlflow_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.mlflow_conn_id = mlflow_conn_id

    def get_client(self) -> Any:
        """A checked ``MlflowClient`` (``TrackingUnavailable`` when the server does not answer)."""
        return connect(load_target(self.mlflow_conn_id))

    def test_connection(self) -> tuple[bool, str]:
        """The connection form's Test button: does the server answer and take the credentials?"""
        try:
            self.get_client()
        except Exception as exc:
            return False, str(exc)
        return True, "The MLflow tracking server answered."
