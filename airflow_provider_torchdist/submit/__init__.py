"""Submission: from the operator's settings to a started Spark application.

The settings checks (``checks``, ``validation``, ``train_module``, ``masking``; ``argument_names``:
an unknown argument with the closest known one; ``script_args``: a script's argv; ``local_cores``:
more local ranks than cores, warned once), the connection and
its target (``connection``), the plan for spark-submit (``plan``, ``properties``, ``fast_start``,
``jvm``), the engines that run a plan (``spark_submit``; ``connect``, for Spark Connect), staging
the callable or script with its arguments (``staging``, ``payload``, ``py_files``), the checks before spark-submit (``preflight``), the whole
preparation in order (``prepare``), and following the driver's channel (``follow``).

It may import ``outputs``, ``spark`` and the package's core (``errors``, ``spec``, ``links``); never
``supervision``, ``hooks``, ``triggers``, ``operators`` or ``ui``.
"""
