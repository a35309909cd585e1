"""Triggers: wait for a training run in Airflow's triggerer while the task is deferred."""
