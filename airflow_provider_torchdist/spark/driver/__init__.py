"""The Spark driver's side of a run: its SparkContext, the run channel and what Spark's
scheduler says.

The SparkContext (``spark_context``), the authenticated run channel the ranks report to
(``channel``, ``ledger``, ``output_receipt``, ``rank_logs``), the owner stream the Airflow side
follows (``owner``), and the scheduler's view of executors (``scheduler_identity``, ``jvm_status``,
``executor_loss``, ``slots``; ``master_state``: what holds the slots, as the master's web UI says),
and the hang watchdog (``hang_detection``, ``hang_watch``).

It may import ``node`` and ``wire``.
"""
