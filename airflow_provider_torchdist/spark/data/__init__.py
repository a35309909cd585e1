"""``train_data``: a DataFrame dealt to the ranks as files on their own nodes.

The plan of who gets which rows (``shard_plan``), the files on each node (``shard_files``), the two
routes to them (``data_shards``, ``same_host_shards``), and the ranks' reader (``rank_data``:
``rank_shard()``, ``rank_batches()``; ``batch_order``: its epochs, reshuffled and resumed exactly).

It may import ``driver``, ``node`` and ``wire``.
"""
