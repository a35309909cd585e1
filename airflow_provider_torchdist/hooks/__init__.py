"""The hook: plans a training run and submits it, through the Spark provider's ``SparkSubmitHook``.

``torch_distributor`` is the hook (its path is Airflow's convention: keep it), ``arguments`` turns
the hook's keyword arguments into the one typed spec, ``in_process`` runs a whole run in the
caller's process (``hook.run()``), and ``supervised`` hands one to a detached supervisor and owns
it (``start_run()``, ``follow()``: the operator's path).

It may import ``supervision``, ``submit``, ``outputs``, ``spark`` and the package's core; never
``triggers``, ``operators`` or ``ui``.
"""
