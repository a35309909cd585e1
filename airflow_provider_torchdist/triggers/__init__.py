"""Triggers: wait for a training run in Airflow's triggerer while the task is deferred.

``torch_distributor`` holds the trigger (its classpath is in Airflow's database for every deferred
task: keep it). It follows the run over its lifeline and may import ``supervision`` and below;
never ``hooks``, ``operators`` or ``ui``.
"""
