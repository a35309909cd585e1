"""What runs on a cluster node: the barrier task, torchrun's agent and each rank.

The barrier task (``barrier``), the agent that starts torchrun for one node (``launcher``, with
``rendezvous``, ``signed_rendezvous``, ``network``), and what each rank runs and sends back
(``rank``, ``rank_context``, ``rank_output``, ``output_capture``, ``storage_pickling``,
``channel_client``; ``progress`` and ``watchdog``, the hang watchdog's thread), with the rank-side
API: ``metrics`` (``report()``) and ``checkpoints`` (with ``checkpoint_saves``; sharded states
through ``sharded_checkpoints`` and ``dcp_checks``; ``async_saves``; ``resume_position`` and
``rng_states``: a rank's place in its data and its random generators, saved and restored with
each checkpoint).

It may import ``wire`` only.
"""
