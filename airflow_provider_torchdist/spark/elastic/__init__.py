"""Elastic world sizes (``num_processes="MIN:MAX"``): stages that shrink and grow.

The driver's loop over stages (``run``), the node-side task with its c10d store (``task``), and the
history of world sizes (``world_sizes``).

It may import ``driver``, ``node`` and ``wire``.
"""
