"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

#: The ``[torchdist]`` options, as Airflow's configuration reads them: declaring them is what makes
#: ``output_signing_key`` and ``view_status_key`` sensitive, so that their ``_CMD`` and ``_SECRET``
#: forms are resolved and ``conf.as_dict(display_sensitive=False)`` (the REST API's config
#: endpoint) hides them. Each default is the code's fallback where it reads the option;
#: ``tests/unit/test_get_provider_info.py`` checks that every option the code reads is here.
CONFIG: dict[str, Any] = {
    "torchdist": {
        "description": "PyTorch distributed training on Spark (airflow-provider-torchdist).",
        "options": {
            "output_signing_key": {
                "description": "The deployment's output signing key (at least 32 bytes): outputs are "
                "signed with it, owners of a run derive their lifeline credential from it. The same on "
                "every worker and triggerer. Without one, a random key is made once in "
                "$AIRFLOW_HOME/torchdist_output_signing.key (one machine only). Set its _cmd or _secret "
                "form to read it from a command or a secrets backend; when such a form is set but "
                "yields nothing, tasks refuse to run.",
                "version_added": "0.1.0",
                "type": "string",
                "example": "(64 hex characters: python -c 'import secrets; print(secrets.token_hex(32))')",
                "default": None,
                "sensitive": True,
            },
            "checkpoint_runs_kept": {
                "description": "How many DAG runs' default checkpoint directories "
                "($AIRFLOW_HOME/torchdist-checkpoints/<dag>/<run>/<task>) a task keeps: when a run "
                "succeeds, the directories of older finished runs of the same task beyond this many "
                "(this run included) are removed. Unfinished runs' are kept (a retry resumes them); a "
                "checkpoint_dir you set is never pruned this way. 0: keep all.",
                "version_added": "0.1.0",
                "type": "integer",
                "example": None,
                "default": "3",
            },
            "view_status_key": {
                "description": "What the API server's Training view asks running supervisors for their "
                "status with: a key derived from output_signing_key for status queries only "
                "(python -m airflow_provider_torchdist status-key prints it). It cannot stop, follow "
                "or fetch a run, nor sign outputs. Unset, the view derives it from output_signing_key "
                "if the API server has that.",
                "version_added": "0.1.0",
                "type": "string",
                "example": None,
                "default": None,
                "sensitive": True,
            },
            "lifeline_host": {
                "description": "Where each run's supervisor listens for its owners (the task, the "
                "trigger, a durable retry). On loopback (the default) it is a unix socket in the run's "
                "private staging directory, which other users cannot connect to. Keep it on loopback "
                "unless triggerers or retries run on other machines.",
                "version_added": "0.1.0",
                "type": "string",
                "example": "10.0.0.5",
                "default": "127.0.0.1",
            },
            "view_lifeline_hosts": {
                "description": "Comma-separated hosts, besides lifeline_host, whose supervisors may be "
                "connected to: the Training view (a live run's history), the trigger, execute_complete "
                "and a retry (workers on other machines). A run record naming any other host is refused.",
                "version_added": "0.1.0",
                "type": "string",
                "example": "10.0.0.12, worker-2",
                "default": "",
            },
            "mlflow_conn_id": {
                "description": "The mlflow connection every TorchDistributorOperator logs its run to "
                "when it sets no mlflow_conn_id of its own (docs/tracking.md); empty: no tracking. Needs "
                'pip install "airflow-provider-torchdist[mlflow]" on the workers and DAG processors.',
                "version_added": "0.1.0",
                "type": "string",
                "example": "mlflow_default",
                "default": "",
            },
            "supervisor_start": {
                "description": "How a run's supervisor starts: fork (from the task's process, fast) or "
                "exec (a new interpreter, for libraries that do not survive a fork).",
                "version_added": "0.1.0",
                "type": "string",
                "example": "exec",
                "default": "fork",
            },
        },
    }
}


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
            },
            {
                # mlflow_conn_id (docs/tracking.md): the tracking server a training task logs its run to.
                "connection-type": "mlflow",
                "hook-class-name": "airflow_provider_torchdist.operators.tracking.hook.MlflowTrackingHook",
                "hook-name": "MLflow tracking server",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema"],
                    "relabeling": {"host": "Tracking URI"},
                    "placeholders": {"host": "http://mlflow.internal:5000", "port": "(in the URI)"},
                },
                "conn-fields": {
                    "token": {
                        "label": "Bearer token",
                        "description": "Sent as MLFLOW_TRACKING_TOKEN (instead of login/password).",
                        "schema": {"type": ["string", "null"]},
                        "sensitive": True,
                    },
                    "experiment_name": {
                        "label": "Experiment",
                        "description": "The MLflow experiment the runs go to (default: the DAG id).",
                        "schema": {"type": ["string", "null"]},
                    },
                },
            },
        ],
        # The buttons on a train task instance (TorchDistributorOperator.operator_extra_links).
        "extra-links": [
            "airflow_provider_torchdist.links.SparkUILink",
            "airflow_provider_torchdist.links.SparkMasterAppLink",
            "airflow_provider_torchdist.links.SparkHistoryServerLink",
            "airflow_provider_torchdist.links.MlflowRunLink",
        ],
        # @task.torch_distributor: Airflow's ``task`` object finds it here.
        "task-decorators": [
            {
                "name": "torch_distributor",
                "class-name": "airflow_provider_torchdist.decorators.torch_distributor.torch_distributor_task",
            }
        ],
        # The "Training" tab on task instance pages and its JSON endpoint (Airflow 3.1+ external views).
        "plugins": [
            {"name": "torchdist", "plugin-class": "airflow_provider_torchdist.ui.plugin.TorchdistPlugin"}
        ],
        # The [torchdist] options (above).
        "config": CONFIG,
    }
