"""The job spec: the one description of a run that the hook writes and the driver reads.

Serialized once to JSON by the Airflow side (``TorchDistributorHook``) and read back by
``airflow_provider_torchdist.spark.driver``. Standard library only: it runs on the cluster.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SPEC_FILE = "spec.json"
PAYLOAD_FILE = "payload.pkl"
OUTPUT_FILE = "output.pkl"
#: Beside the output file: ``{"sha256", "size", "ino", "mtime_ns"}`` of it, as the driver received it.
OUTPUT_DIGEST_SUFFIX = ".sha256"
OUTCOME_FILE = "outcome.json"

Kind = Literal["callable", "script"]


@dataclass(frozen=True)
class JobSpec:
    """Everything the Spark side needs to run one training job.

    Example::

        spec = JobSpec(kind="callable", entry=PAYLOAD_FILE, num_processes=2, run_id="abc", token="...")
        JobSpec.from_json(spec.to_json()) == spec
    """

    kind: Kind
    #: File name (inside the staging dir, shipped with ``--files``) of the pickled payload or the script.
    entry: str
    num_processes: int
    run_id: str
    #: Per-run secret: only connections that present it may talk to the driver's channel.
    token: str
    local_mode: bool = False
    use_gpu: bool = False
    nproc_per_node: int = 1
    #: Command-line arguments of a script (script mode only).
    script_args: list[str] = field(default_factory=list)
    max_restarts: int = 0
    #: Seconds the ranks may take to find each other before the run fails.
    rendezvous_timeout: int = 300
    #: Seconds to wait for executors to offer the slots the barrier stage needs before failing;
    #: None when the hook knows the cluster can fit the stage (then it waits as long as it takes).
    slot_timeout: float | None = 20.0
    #: Network interface for gloo/NCCL; None picks the one that carries the task's address.
    socket_ifname: str | None = None
    #: Extra environment for every rank.
    rank_env: dict[str, str] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """How many torchrun agents (barrier tasks) the run uses."""
        return 1 if self.local_mode else self.num_processes // self.nproc_per_node

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls(**json.loads(text))

    def write(self, staging_dir: Path) -> Path:
        path = Path(staging_dir) / SPEC_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: str | Path) -> JobSpec:
        return cls.from_json(Path(path).read_text())
