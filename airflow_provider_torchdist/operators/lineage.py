"""OpenLineage: the task's identity in the Spark application's properties, as ``SparkSubmitOperator``
gives it.

With ``apache-airflow-providers-openlineage`` installed, the OpenLineage provider's helpers add
``spark.openlineage.*`` properties to the run's Spark conf: the parent job (this task try, and its
DAG run as the root) and, when asked, the provider's HTTP transport. The Spark OpenLineage listener,
when the application loads it, then reports the application's runs as children of the task. What
``conf`` already holds wins: a helper adds nothing of its group (``spark.openlineage.parent*``,
``spark.openlineage.transport*``) once ``conf`` has any of it.

Example::

    conf = inject_openlineage(spec.conf, context, parent_job_info=True, transport_info=False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def inject_openlineage(
    conf: Mapping[str, Any], context: Any, *, parent_job_info: bool, transport_info: bool
) -> dict[str, Any]:
    """``conf`` with the OpenLineage properties asked for added; unchanged when neither is asked
    for, or (with a warning in the log) when the OpenLineage provider is not installed."""
    conf = dict(conf)
    if not (parent_job_info or transport_info):
        return conf
    # Imported only when asked for: the OpenLineage helpers load the provider's listener and client,
    # which parsing a DAG has no use for. Without the provider, the compat module's stand-ins (the
    # Spark provider's too) log a warning and return the properties unchanged.
    from airflow.providers.common.compat.openlineage.utils.spark import (
        inject_parent_job_information_into_spark_properties,
        inject_transport_information_into_spark_properties,
    )

    if parent_job_info:
        conf = inject_parent_job_information_into_spark_properties(conf, context)
    if transport_info:
        conf = inject_transport_information_into_spark_properties(conf, context)
    return conf
