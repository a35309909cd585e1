"""The training driver over Spark Connect (``python -m airflow_provider_torchdist.spark.connect.driver``).

It may import every other part of ``spark``.
"""
