"""The training driver over Spark Connect (``python -m airflow_provider_torchdist.spark.connect.driver``).

``driver`` runs the barrier stage as a tagged job on a Connect session (``sessions``: the one this
user's runs share); ``job`` checks and watches that job (the nodes that join the channel, the slots,
the payload's size, its operation); ``node_task`` is what each of its tasks runs on the server's
executors.

It may import every other part of ``spark``.
"""
