"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` shows, validated against Airflow's ``provider_info.schema.json``.

    No ``connection-types``: the hook uses the Spark provider's ``spark`` connection type as it is
    (``TorchDistributorHook`` subclasses ``SparkSubmitHook``; default ``spark_default``, or an
    embedded local master when that is undefined). Airflow 3.3 describes a connection's form
    (``conn-fields``, ``ui-field-behaviour``) only inside a ``connection-types`` entry, and a
    second provider declaring ``spark`` is ignored with a warning, so the Spark provider's own
    form (host, port, deploy-mode, queue, spark-binary, namespace, ...) stays the one in the UI.
    """
    from airflow_provider_torchdist import __version__

    return {
        "package-name": "airflow-provider-torchdist",
        "name": "PyTorch distributed training on Spark",
        "description": "Run a PyTorch training callable or script on Spark (barrier executors + torchrun) "
        "and hand rank 0's result to later tasks.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "PyTorch on Spark",
                "external-doc-url": "https://pytorch.org/docs/stable/elastic/run.html",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "PyTorch on Spark",
                "python-modules": ["airflow_provider_torchdist.operators.torch_distributor"],
            }
        ],
        "hooks": [
            {
                "integration-name": "PyTorch on Spark",
                "python-modules": ["airflow_provider_torchdist.hooks.torch_distributor"],
            }
        ],
        # The "Spark UI" button on a train task instance (TorchDistributorOperator.operator_extra_links).
        "extra-links": [
            "airflow_provider_torchdist.links.SparkUILink",
            "airflow_provider_torchdist.links.SparkMasterAppLink",
        ],
    }
