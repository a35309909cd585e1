"""The Spark side of the provider: the driver application, the launcher and what each rank runs.

Nothing here imports Airflow: cluster nodes need only pyspark, torch and cloudpickle. The hook ships
this sub-package to the cluster with ``--py-files``.
"""
