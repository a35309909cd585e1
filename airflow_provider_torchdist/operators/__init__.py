"""The operator: renders a task's settings, orchestrates its run and publishes what it made.

``torch_distributor`` is the operator (its path is Airflow's convention: keep it), ``run_control``
its run's control (start, reattach, defer, follow, stop); ``xcom`` pushes
rank 0's output and the run's links and metrics, ``outlet_events`` the trained model's asset
events, ``lineage`` the OpenLineage facets, ``tracking/`` the task's MLflow run (``mlflow_conn_id``).

It may import every layer below it (``triggers``, ``hooks``, ``supervision``, ``submit``,
``outputs``, ``spark`` and the package's core); never ``ui``.
"""
