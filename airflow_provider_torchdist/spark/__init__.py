"""The Spark side of the provider: the driver application, the launcher and what each rank runs.

Nothing here imports Airflow: cluster nodes need only pyspark, torch and cloudpickle. The hook ships
this sub-package to the cluster with ``--py-files``. Its layers, top first, each importing only the
ones below it: ``connect`` (the driver over Spark Connect), ``app`` (the application spark-submit
runs), ``data`` and ``elastic``, ``driver`` (the driver's SparkContext and run channel), ``node``
(the barrier task, torchrun's agent and the ranks) and ``wire`` (messages, files and formats).
"""
