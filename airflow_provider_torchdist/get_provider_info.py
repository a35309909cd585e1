"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


# size: one literal, the provider metadata Airflow reads; splitting it would hide its shape.
def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` shows, validated against Airflow's ``provider_info.schema.json``.

    The hook works with the Spark provider's ``spark`` connections as they are. It also declares a
    ``torchdist_spark`` connection type ("PyTorch on Spark"): the same fields, plus the one this
    provider adds (the standalone master's web UI, for the slot check before submitting and the
    master-page link; the Spark history server, for the history link), described declaratively so the UI's connection form shows them. Declaring
    ``spark`` itself again would be ignored, with a warning, in favour of the Spark provider's.
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
        # Deferrable operators wait in the triggerer (TorchDistributorOperator(deferrable=True)).
        "triggers": [
            {
                "integration-name": "PyTorch on Spark",
                "python-modules": ["airflow_provider_torchdist.triggers.torch_distributor"],
            }
        ],
        "connection-types": [
            {
                "connection-type": "torchdist_spark",
                "hook-class-name": "airflow_provider_torchdist.hooks.torch_distributor.TorchDistributorHook",
                "hook-name": "PyTorch on Spark",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "password", "extra"],
                    "relabeling": {"host": "Master"},
                    "placeholders": {
                        "host": "spark://spark-master.example.com, yarn, or k8s://https://k8s-api:6443",
                        "port": "7077 (standalone master port, if not in Master)",
                    },
                },
                "conn-fields": {
                    "master-web-ui": {
                        "label": "Master web UI",
                        "description": "A standalone master's web UI, e.g. http://spark-master:8080. With "
                        "it, a job too big for the cluster fails before submitting, and the task gets a "
                        "link to the application's page on the master.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "history-server-url": {
                        "label": "Spark history server",
                        "description": "The Spark history server, e.g. http://spark-history:18080. With "
                        "it, the task links to the run's page there, which stays after the run ends (the "
                        "Spark UI link is the driver's own UI, gone with the run). The application must "
                        "write its event log where the history server reads (spark.eventLog.enabled, "
                        "spark.eventLog.dir).",
                        "schema": {"type": ["string", "null"]},
                    },
                    "queue": {
                        "label": "YARN queue",
                        "description": "YARN queue to submit to.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "namespace": {
                        "label": "Kubernetes namespace",
                        "schema": {"type": ["string", "null"]},
                    },
                    "spark-binary": {
                        "label": "Spark binary",
                        "description": "spark-submit, spark2-submit or spark3-submit, found on PATH.",
                        "schema": {"type": ["string", "null"], "default": "spark-submit"},
                    },
                },
            }
        ],
        # The buttons on a train task instance (TorchDistributorOperator.operator_extra_links).
        "extra-links": [
            "airflow_provider_torchdist.links.SparkUILink",
            "airflow_provider_torchdist.links.SparkMasterAppLink",
            "airflow_provider_torchdist.links.SparkHistoryServerLink",
        ],
        # The "Training" tab on task instance pages and its JSON endpoint (Airflow 3.1+ external views).
        "plugins": [
            {"name": "torchdist", "plugin-class": "airflow_provider_torchdist.ui.plugin.TorchdistPlugin"}
        ],
    }
