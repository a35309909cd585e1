"""The job spec: the one description of a run that the hook writes and the driver reads.

``JobSpec`` is :class:`~airflow_provider_torchdist.spec.TrainingSpec` (less what only spark-submit
needs: ``TrainingSpec.for_cluster``) plus the run's identity: what to run, the run id and the
channel token. Serialized once to JSON by the Airflow side and read back by
``airflow_provider_torchdist.spark.app``. Standard library only: it runs on the cluster.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from airflow_provider_torchdist.spark.wire.outcome import OUTCOME_FILE  # noqa: F401 - named with the others
from airflow_provider_torchdist.spec import TrainingSpec

SPEC_FILE = "spec.json"
PAYLOAD_FILE = "payload.pkl"
OUTPUT_FILE = "output.pkl"
#: A callable ``train_data``, pickled: read by the driver from its staging directory, never shipped.
DATA_FILE = "train_data.pkl"
#: The owner token the hook writes for the driver alone (0600); never in the spec, which executors get.
OWNER_TOKEN_FILE = "owner.token"
#: Where the driver's run channel listens, ``{"host", "port"}``, written by the driver for the hook.
CHANNEL_FILE = "channel.json"

Kind = Literal["callable", "script", "module"]


@dataclass(frozen=True, kw_only=True)
class JobSpec(TrainingSpec):
    """Everything the Spark side needs to run one training job: the settings and the run identity.

    Example::

        spec = JobSpec(kind="callable", entry=PAYLOAD_FILE, num_processes=2, run_id="abc", token="...")
        JobSpec.from_json(spec.to_json()) == spec
    """

    kind: Kind
    #: File name (inside the staging dir, shipped with ``--files``) of the pickled payload or the
    #: script; the dotted module name in module mode (nothing shipped).
    entry: str
    run_id: str
    #: Per-run secret: only connections that present it may talk to the driver's channel.
    token: str
    #: Command-line arguments of a script or module.
    script_args: list[str] = field(default_factory=list)
    #: ``DATA_FILE`` when ``train_data`` is a callable (``train_data`` is then None here).
    data_file: str | None = None
    #: The standalone master's web UI (the connection's extra ``master-web-ui``), for the driver
    #: to say what holds the task slots it waits for; None when the connection gives none.
    master_web_ui: str | None = None

    @classmethod
    def for_run(cls, training: TrainingSpec, **identity: object) -> JobSpec:
        """The job of one run of ``training``: its cluster settings plus ``identity``
        (``kind``, ``entry``, ``run_id``, ``token``, ``script_args``, and run-time values such as the
        effective ``slot_timeout``)."""
        settings = dataclasses.asdict(training.for_cluster())
        return cls(**{**settings, **identity})  # type: ignore[arg-type]

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
