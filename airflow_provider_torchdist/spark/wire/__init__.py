"""What crosses a process or machine boundary: messages, files and their formats.

The run channel's messages and their authentication (``message``, the base; ``protocol``, the
kinds, with the hang watchdog's in ``watchdog_messages``; ``json_lines``, ``channel_auth`` with
``node_claims`` and ``peer_hosts``), Spark Connect's
operation ids (``connect_ids``), the job spec the hook writes and the verdict the driver writes
(``jobspec``, ``outcome``), rank 0's output on its way out (``output_store``), phase events,
private atomic files and log escaping.

It imports nothing of the package but ``spec``: both the Airflow side and the cluster read it.
"""
