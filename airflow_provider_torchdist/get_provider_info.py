"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
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
    }
