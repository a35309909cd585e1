"""One launch through Ray Train's ``TorchTrainer``: ``<.venv-ray python> ray_train.py [--address A]``.

The peer the issue asks for (Ray Train 2.x, CPU, gloo), run in its own environment (``.venv-ray``,
made by ``bench/ray-env``: Ray is no dependency of this project). Without ``--address`` it is the
*cold* start: ``ray.init`` starts a new single-node cluster on 127.0.0.1 in this process and takes
it down at exit. With ``--address`` it joins a cluster that is already running (the *warm* start:
``launch.py`` starts one with ``ray start --head`` before the rounds and stops it after).

The two workers run the same work as every other launcher (:func:`ddp_trivial.work`): Ray Train
makes the gloo process group itself, so the function that would make its own is not called. Prints
one ``RESULT {json}`` line with rank 0's value, as ``hook_run.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

T_PROCESS = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def loop(config: dict) -> None:
    """Each Ray Train worker: the trivial workload in the group Ray made; rank 0 writes its value
    where the launching process reads it (Ray Train 2.x keeps no metrics reported without a
    checkpoint in ``Result.metrics``; the file is on this one machine)."""
    import torch.distributed as dist
    from ddp_trivial import work

    value = work()
    if dist.get_rank() == 0:
        with open(config["value_file"], "w") as f:
            json.dump(value, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running Ray cluster (warm); none: start one here (cold)")
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t_run = time.time()
    if args.address:
        ray.init(address=args.address, logging_level="ERROR")
    else:
        # Logical CPUs: 2 workers and Ray Train's own coordinator.
        # address="local": a new cluster even while another one (ray_warm's) runs on this machine.
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="ERROR",
        )
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as storage:
        value_file = os.path.join(storage, "value.json")
        trainer = TorchTrainer(
            loop,
            train_loop_config={"value_file": value_file},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=storage, name="bench"),
        )
        trainer.fit()
        with open(value_file) as f:
            value = json.load(f)
    t_done = time.time()
    ray.shutdown()
    assert value["world_size"] == 2 and value["allreduce"] == 3.0, value
    print("RESULT " + json.dumps({"value": value, "run_s": t_done - t_run, "t_run": t_run, "t_done": t_done}))


if __name__ == "__main__":
    main()
