"""The run's lifetime: the detached supervisor that owns a run, and the task's side of it.

The supervisor process (``supervisor``, ``run_supervisor``, ``submission``, ``config``, ``owners``,
``lock``), what it sweeps and how it stops processes (``sweep``, ``processes``), the task's side
(``task_side``: start, find and follow a run), the run's durable record (``record``) and deadline
(``deadline``), and the lifeline between them (``lifeline/``).

It may import ``submit``, ``outputs``, ``spark`` and the package's core; never ``hooks``,
``triggers``, ``operators`` or ``ui``.
"""
