"""Experiment tracking: each training task instance as one MLflow run (docs/tracking.md).

Airflow side only, logged from the process that follows the run (the task, or the task resumed
after its trigger): the ranks' ``report()`` metrics already travel there over the run channel, so
the ranks need no MLflow credentials and no route to the tracking server. ``mlflow`` (the
``[mlflow]`` extra: ``mlflow-skinny``) is imported on first use only.

Modules: connection (the ``mlflow`` connection: URI, auth, the start-of-task check), identity
(the run's tags and params, pure), runs (find, continue or create the run, and a sweep's parent),
metric_log (the bounded buffer and the background thread that log metrics), models (log a model,
register a version: :func:`~airflow_provider_torchdist.operators.tracking.models.register_model`),
hook (the ``mlflow`` connection type's hook), task_run (what the operator calls: open, feed, close).
"""
