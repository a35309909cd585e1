"""``use_gpu=True`` on a real GPU, without Spark: our barrier task's code path against raw torchrun.

Run on a machine with one NVIDIA GPU (no Java, pyspark or Airflow needed)::

    python3 bench/gpu_check.py --out DIR          # on the GPU
    python3 bench/gpu_check.py --out DIR --cpu-smoke   # CPU-only smoke test of this script (gloo)

What it drives: :func:`airflow_provider_torchdist.spark.node.barrier.barrier_task` itself, the
function a Spark barrier stage maps over its partitions, with a fake ``pyspark`` module standing in
for ``BarrierTaskContext`` and ``SparkFiles`` (the way Spark's own tests fake GPU discovery: the
task's ``resources()`` hands it GPU address ``"0"``). The driver's end is the real run channel
(:class:`~airflow_provider_torchdist.spark.driver.channel.RunChannel`), on 127.0.0.1, with a node
verifier that vouches for the fake task in place of Spark's scheduler. Everything below that is our
code unchanged: ``gpu_environment`` sets ``CUDA_VISIBLE_DEVICES``, ``launch_node`` runs torchrun's
agent with our static rendezvous, the rank runs the cloudpickled callable and sends rank 0's value
back over the channel. What it cannot exercise: Spark's own GPU scheduling (discovery script,
``spark.task.resource.gpu.amount``, the scheduler's vouching) and Airflow.

Each launch runs in a fresh Python process, ours and the baseline alike (``python -m
torch.distributed.run --standalone --nproc_per_node 1`` on this same script), interleaved, one
warm-up pair then ``--rounds`` pairs. Results: ``DIR/gpu_check.json`` and ``DIR/gpu_check.txt``,
children's output in ``DIR/gpu_check.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: A child launch that takes longer than this is killed (its process group).
CHILD_TIMEOUT_S = 150


# --------------------------------------------------------------------------------------------------
# The training function: the same in both launches (ours ships it cloudpickled, torchrun runs this
# file as its script). Self-contained: cloudpickle sends it by value.
# --------------------------------------------------------------------------------------------------


def train(
    device: str = "cuda",
    steps: int = 200,
    windows: int = 5,
    warmup: int = 50,
    batch: int = 512,
    width: int = 2048,
    expect_cvd: str | None = None,
    fail: str | None = None,
) -> dict[str, Any]:
    """DDP on ``device`` (NCCL for cuda, gloo for cpu), synthetic data made on the device.

    Asserts what ``use_gpu=True`` promises, inside the rank. ``fail``: ``"oom"`` allocates 16 TiB on
    the GPU after a few steps (a real CUDA error in the rank), ``"raise"`` raises a ValueError.
    """
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if expect_cvd is not None:
        assert cvd == expect_cvd, f"CUDA_VISIBLE_DEVICES={cvd!r}, expected {expect_cvd!r}"
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        assert torch.cuda.is_available(), "torch.cuda.is_available() is False in the rank"
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
        assert dist.get_backend() == "nccl", f"backend {dist.get_backend()!r}"
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    body: list[torch.nn.Module] = []
    for _ in range(4):
        body += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*body, torch.nn.Linear(width, 16)).to(dev)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(99)
    x = torch.randn(batch, width, device=dev, generator=g)
    target = torch.randint(0, 16, (batch,), device=dev, generator=g)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), target)
        loss.backward()
        opt.step()
        return loss

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for i in range(warmup):
        step()
        if fail and i == 2:
            if fail == "oom" and device == "cuda":
                torch.empty(1 << 44, dtype=torch.uint8, device=dev)  # 16 TiB: cudaMalloc fails
            raise ValueError(f"planted failure in rank {rank} on {dev} after 3 steps")
    sync()
    dist.barrier()
    rates = []
    loss = None
    for _ in range(windows):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        sync()
        rates.append(steps / (time.perf_counter() - t0))
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if device == "cuda" else 0,
        "CUDA_VISIBLE_DEVICES": cvd,
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None,
        "steps_per_window": steps,
        "window_rates": rates,
        "steps_per_s": statistics.median(rates),
        "final_loss": float(loss.item()) if loss is not None else None,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "width": width,
        "max_memory_allocated_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if device == "cuda" else 0,
    }
    dist.destroy_process_group()
    return result


def train_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu_smoke:
        return {"device": "cpu", "steps": 5, "windows": 2, "warmup": 3, "batch": 32, "width": 64}
    return {"device": "cuda"}


# --------------------------------------------------------------------------------------------------
# Child: one launch through our barrier task, with a fake pyspark standing in for Spark.
# --------------------------------------------------------------------------------------------------


class FakeResource:
    """pyspark.resource.ResourceInformation: a resource's name and the addresses given to the task."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name
        self.addresses = addresses


class FakeTaskInfo:
    """pyspark.BarrierTaskInfo: ``address`` is ``host:port`` of the executor running the task."""

    def __init__(self, address: str) -> None:
        self.address = address


class FakeBarrierTaskContext:
    """A one-task barrier stage's BarrierTaskContext, with Spark's GPU assignment in ``resources()``."""

    def __init__(self, gpus: list[str] | None, cpus: int = 1, attempt: int = 7) -> None:
        self._gpus = gpus
        self._cpus = cpus
        self._attempt = attempt

    def partitionId(self) -> int:  # noqa: N802 - pyspark's name
        return 0

    def taskAttemptId(self) -> int:  # noqa: N802
        return self._attempt

    def stageAttemptNumber(self) -> int:  # noqa: N802
        return 0

    def attemptNumber(self) -> int:  # noqa: N802
        return 0

    def cpus(self) -> int:
        return self._cpus

    def resources(self) -> dict[str, FakeResource]:
        return {} if self._gpus is None else {"gpu": FakeResource("gpu", list(self._gpus))}

    def getTaskInfos(self) -> list[FakeTaskInfo]:  # noqa: N802
        return [FakeTaskInfo("127.0.0.1:40000")]

    def allGather(self, message: str = "") -> list[str]:  # noqa: N802 - one task: its own message
        return [message]

    def barrier(self) -> None:  # one task: nothing to wait for
        return None


def install_fake_pyspark(ctx: FakeBarrierTaskContext, staging: Path) -> None:
    """``from pyspark import BarrierTaskContext, SparkFiles`` gets these (sys.modules wins)."""
    module = types.ModuleType("pyspark")

    class BarrierTaskContext:
        @staticmethod
        def get() -> FakeBarrierTaskContext:
            return ctx

    class SparkFiles:
        @staticmethod
        def get(name: str) -> str:
            return str(staging / name)

    module.BarrierTaskContext = BarrierTaskContext  # type: ignore[attr-defined]
    module.SparkFiles = SparkFiles  # type: ignore[attr-defined]
    module.__fake__ = True  # type: ignore[attr-defined]
    sys.modules["pyspark"] = module


def child_ours(args: argparse.Namespace) -> None:
    """One run of ``barrier_task`` (node 0 of a one-node stage) with ``use_gpu=True``; writes the
    outcome as JSON to ``args.result``."""
    t_start = time.time()
    import cloudpickle

    from airflow_provider_torchdist.spark.driver.channel import RunChannel
    from airflow_provider_torchdist.spark.node.barrier import barrier_task
    from airflow_provider_torchdist.spark.wire.jobspec import OUTPUT_FILE, PAYLOAD_FILE, JobSpec
    from airflow_provider_torchdist.spark.wire.output_store import read_output

    assert "torch" not in sys.modules or not sys.modules["torch"].cuda.is_initialized()
    staging = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    kwargs = {**train_kwargs(args), "expect_cvd": None if args.no_gpu_resource else "0", "fail": args.fail}
    with open(staging / PAYLOAD_FILE, "wb") as f:
        cloudpickle.dump({"fn": train, "args": (), "kwargs": kwargs}, f)
    spec = JobSpec(
        kind="callable",
        entry=PAYLOAD_FILE,
        run_id=f"gpucheck{secrets.token_hex(4)}",
        token=secrets.token_hex(16),
        num_processes=1,
        nproc_per_node=1,
        local_mode=False,
        use_gpu=True,
        rendezvous_timeout=60,
    )
    ctx = FakeBarrierTaskContext(None if args.no_gpu_resource else ["0"])
    install_fake_pyspark(ctx, staging)
    verified: list[tuple[int, int, str]] = []

    def verify_node(node: int, attempt: int, peer_ip: str) -> str:  # Spark's scheduler, stood in for
        verified.append((node, attempt, peer_ip))
        assert (node, attempt) == (0, ctx.taskAttemptId()), (node, attempt)
        return "127.0.0.1"

    channel = RunChannel(
        spec.token,
        "127.0.0.1",
        staging,
        ranks_of_node=lambda n: range(n * spec.nproc_per_node, (n + 1) * spec.nproc_per_node),
        verify_node=verify_node,
        echo_stdout=True,
    )
    with channel:
        task_results = list(barrier_task(spec, channel.address, str(staging), iter([0])))
    output_path = staging / OUTPUT_FILE
    value = read_output(output_path) if output_path.exists() else None
    t_result = time.time()
    failures = [vars(f) for f in channel.failures]
    record = {
        "t_child_start": t_start,
        "t_result": t_result,
        "value": value,
        "failures": failures,
        "task_results": [json.loads(r) for r in task_results],
        "cuda_visible_devices_set_by_task": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "verified_nodes": verified,
        "fake_pyspark": bool(getattr(sys.modules.get("pyspark"), "__fake__", False)),
    }
    Path(args.result).write_text(json.dumps(record, default=str))
    shutil.rmtree(staging, ignore_errors=True)


def child_diag(args: argparse.Namespace) -> None:
    """Is CUDA usable in a rank forked by our agent? Builds our ``launch_config`` (torchrun's
    ``LaunchConfig``), then forks as the agent's ``start_method="fork"`` does and touches CUDA in the
    child. ``args.diag``: ``plain`` (no LaunchConfig), ``launchconfig``, ``launchconfig-nvml`` (with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, torch's NVML-based check that does not poison fork)."""
    import torch

    from airflow_provider_torchdist.spark.node.launcher import launch_config
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

    if args.diag == "launchconfig-nvml":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    info: dict[str, Any] = {"mode": args.diag}
    if args.diag != "plain":
        spec = JobSpec(kind="callable", entry="p", run_id="diag", token="t", use_gpu=True)
        cfg = launch_config(spec, node_rank=0, master=("127.0.0.1", 29999), host="127.0.0.1",
                            log_dir=tempfile.mkdtemp())  # fmt: skip
        info["numa_options"] = repr(getattr(cfg, "numa_options", "<no such field>"))
    info["cuda_initialized_in_agent"] = torch.cuda.is_initialized()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "rank"
        os.close(read_end)
        try:
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            msg, code = "ok", 0
        except Exception as exc:  # noqa: BLE001
            msg, code = f"{type(exc).__name__}: {exc}", 3
        os.write(write_end, msg.encode()[:4000])
        os._exit(code)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 4096):
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    info["forked_child_cuda"] = b"".join(chunks).decode()
    info["forked_child_exit"] = os.waitstatus_to_exitcode(status)
    Path(args.result).write_text(json.dumps({"t_child_start": 0, "t_result": time.time(), "diag": info}))


def child_raw(args: argparse.Namespace) -> None:
    """Under ``torchrun``: the same training function; rank 0 writes its value to ``args.result``."""
    t_start = time.time()
    value = train(**train_kwargs(args))
    if value["rank"] == 0:
        record = {"t_child_start": t_start, "t_result": time.time(), "value": value, "failures": []}
        Path(args.result).write_text(json.dumps(record, default=str))


# --------------------------------------------------------------------------------------------------
# Parent: launches, checks, table.
# --------------------------------------------------------------------------------------------------


class Parent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "gpu_check.log", "a", buffering=1)  # noqa: SIM115
        self.results: dict[str, Any] = {"argv": sys.argv, "cpu_smoke": args.cpu_smoke, "checks": {}}
        self.t0 = time.monotonic()
        self.env = dict(os.environ)
        self.preset_cvd = self.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        # Spark gives its Python workers OMP_NUM_THREADS = spark.task.cpus (1 by default); raw
        # torchrun with one process leaves it unset. Each launcher gets what it would get.
        self.results["preset_CUDA_VISIBLE_DEVICES"] = self.preset_cvd
        # torch's LaunchConfig.__post_init__ calls torch.cuda.is_available() in the agent, which
        # (unless this is set) initializes the CUDA driver and poisons fork: every rank our agent
        # forks then fails at its first CUDA call. Set for both launchers, like for like.
        self.workaround = not args.no_nvml_workaround and not args.cpu_smoke
        if self.workaround:
            self.env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        self.results["PYTORCH_NVML_BASED_CUDA_CHECK"] = self.env.get("PYTORCH_NVML_BASED_CUDA_CHECK")

    def say(self, text: str) -> None:
        line = f"[gpu_check +{time.monotonic() - self.t0:6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.results["checks"][name] = {"ok": bool(ok), "detail": detail}
        self.say(f"CHECK {'PASS' if ok else 'FAIL'} {name}: {detail if detail is not None else ''}")
        self.save()
        return ok

    def launch(self, kind: str, *extra: str, as_shipped: bool = False) -> dict[str, Any]:
        """One fresh-process launch; wall time from just before the process starts.

        ``as_shipped``: without the ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` workaround."""
        result = Path(tempfile.mkstemp(prefix=f"gpu-check-{kind}-", suffix=".json")[1])
        result.unlink()
        me = str(Path(__file__).resolve())
        common = ["--result", str(result), *(["--cpu-smoke"] if self.args.cpu_smoke else []), *extra]
        if kind in ("ours", "diag"):
            cmd = [sys.executable, me, "--child", kind, *common]
            env = {**self.env, "OMP_NUM_THREADS": "1"}
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                me, "--child", "raw", *common,
            ]  # fmt: skip
            env = dict(self.env)
        if as_shipped:
            env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        self.log.write(f"\n===== {kind} {' '.join(extra)}: {' '.join(cmd)}\n")
        t_start = time.time()
        proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        try:
            rc = proc.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        t_end = time.time()
        record: dict[str, Any] = {
            "kind": kind,
            "extra": list(extra),
            "rc": rc,
            "wall_exit_s": t_end - t_start,
        }
        if result.exists():
            data = json.loads(result.read_text())
            result.unlink()
            record.update(data)
            record["wall_result_s"] = data["t_result"] - t_start
            record["startup_s"] = data["t_child_start"] - t_start
        if "diag" in record:
            self.say(f"diag {' '.join(extra)}: {json.dumps(record['diag'])}")
            return record
        self.say(
            f"{kind:4s} {' '.join(extra) or 'train'}{' (as shipped)' if as_shipped else ''}: rc={rc} wall(result)={record.get('wall_result_s', float('nan')):.2f}s "
            f"wall(exit)={record['wall_exit_s']:.2f}s steps/s="
            f"{(record.get('value') or {}).get('steps_per_s', float('nan')):.1f} failures={len(record.get('failures', []))}"
        )
        return record


def unit_checks(p: Parent) -> None:
    """``gpu_environment`` / ``visible_devices`` themselves (no GPU needed)."""
    from airflow_provider_torchdist.spark.node.barrier import gpu_environment, visible_devices
    from airflow_provider_torchdist.spark.wire.jobspec import JobSpec

    def spec(**kw: Any) -> JobSpec:
        return JobSpec(kind="callable", entry="p", run_id="r", token="t", **kw)

    saved = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        p.check("unit: use_gpu=False sets nothing", gpu_environment(spec(use_gpu=False), ["0"]) == {})
        p.check(
            "unit: use_gpu=True, GPU '0' assigned -> CUDA_VISIBLE_DEVICES=0",
            gpu_environment(spec(use_gpu=True), ["0"]) == {"CUDA_VISIBLE_DEVICES": "0"},
        )
        try:
            gpu_environment(spec(use_gpu=True), None)
            p.check("unit: use_gpu=True, no GPU assigned -> clear error", False, "no error raised")
        except RuntimeError as exc:
            p.check(
                "unit: use_gpu=True, no GPU assigned -> clear error",
                "Spark assigned this task no GPU" in str(exc),
                str(exc),
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        try:
            gpu_environment(spec(use_gpu=True), ["0"])
            p.check("unit: preset CUDA_VISIBLE_DEVICES excluding the assigned GPU -> error", False, "none")
        except RuntimeError as exc:
            p.check("unit: preset CUDA_VISIBLE_DEVICES excluding the assigned GPU -> error", True, str(exc))
        p.check(
            "unit: visible_devices intersects with the preset",
            visible_devices(["1", "0"], "0,1") == ["1", "0"] and visible_devices(["0", "2"], "0,1") == ["0"],
        )
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def machine_facts(p: Parent) -> None:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "host_cpus": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            facts["nvidia_smi"] = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,uuid", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            facts["nvidia_smi"] = f"failed: {exc!r}"
    for mod in ("torch", "cloudpickle", "pyspark", "airflow"):
        try:
            found = subprocess.run(
                [sys.executable, "-c", f"import importlib.metadata as m; print(m.version('{mod}'))"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            facts[f"{mod}_version"] = found.stdout.strip() or "not installed"
        except Exception as exc:  # noqa: BLE001
            facts[f"{mod}_version"] = repr(exc)
    p.results["machine"] = facts
    p.say(f"machine: {json.dumps(facts)}")
    p.save()


def fork_checks(p: Parent) -> None:
    """Why ranks forked by our agent could not use CUDA, and whether the workaround fixes it."""
    diags = {}
    for mode in ("plain", "launchconfig", "launchconfig-nvml"):
        diags[mode] = p.launch("diag", "--diag", mode, as_shipped=True).get("diag", {})
    p.results["fork_diag"] = diags
    if p.args.cpu_smoke:
        return
    p.results["findings"] = {
        "fork_after_import_torch_ok": diags["plain"].get("forked_child_cuda") == "ok",
        "fork_after_our_launch_config_ok": diags["launchconfig"].get("forked_child_cuda") == "ok",
        "fork_after_our_launch_config_with_nvml_check_ok": diags["launchconfig-nvml"].get("forked_child_cuda")
        == "ok",
    }
    p.say(f"findings: {json.dumps(p.results['findings'])}")
    r = p.launch("ours", as_shipped=True)
    fs = r.get("failures") or []
    p.results["as_shipped_launch"] = r
    p.results["findings"]["as_shipped_launch_ok"] = bool(r.get("value")) and not fs
    p.results["findings"]["as_shipped_launch_failure"] = fs[0].get("message") if fs else None
    p.save()


def main_checks(p: Parent) -> None:
    gpu = not p.args.cpu_smoke
    value_ok = lambda r: bool(r.get("value")) and not r.get("failures") and r.get("rc") == 0  # noqa: E731
    launches: list[dict[str, Any]] = []
    p.results["launches"] = launches

    # Warm-up pair (discarded from the table): page cache, CUDA/NCCL first-use costs.
    for kind in ("ours", "raw"):
        r = p.launch(kind)
        r["warmup"] = True
        launches.append(r)
        p.save()
    first_ours = launches[0]
    v = first_ours.get("value") or {}
    p.check("ours: training ran and rank 0's value came back over the channel", value_ok(first_ours),
            {"rc": first_ours.get("rc"), "failures": first_ours.get("failures")})  # fmt: skip
    p.check("ours: CUDA_VISIBLE_DEVICES in the rank is what gpu_environment set ('0')",
            v.get("CUDA_VISIBLE_DEVICES") == "0" and first_ours.get("cuda_visible_devices_set_by_task") == "0",
            {"rank": v.get("CUDA_VISIBLE_DEVICES"), "task": first_ours.get("cuda_visible_devices_set_by_task")})  # fmt: skip
    if gpu:
        p.check("ours: torch.cuda.is_available() in the rank, one device visible",
                v.get("cuda_available") is True and v.get("cuda_device_count") == 1,
                {"available": v.get("cuda_available"), "count": v.get("cuda_device_count"),
                 "name": v.get("device_name")})  # fmt: skip
        p.check("ours: dist.get_backend() == 'nccl'", v.get("backend") == "nccl", v.get("backend"))
    p.check("ours: the node was vouched for once, as task attempt 7 of partition 0 (fake scheduler)",
            first_ours.get("verified_nodes") == [[0, 7, "127.0.0.1"]], first_ours.get("verified_nodes"))  # fmt: skip
    p.check("ours: pyspark was the fake (no Spark involved)", first_ours.get("fake_pyspark") is True)

    rounds = 1 if p.args.cpu_smoke else p.args.rounds
    for i in range(rounds):
        order = ("ours", "raw") if i % 2 == 0 else ("raw", "ours")
        for kind in order:
            if time.monotonic() - p.t0 > p.args.budget_s:
                p.say(f"budget of {p.args.budget_s}s spent: round {i + 1} {kind} skipped")
                continue
            r = p.launch(kind)
            r["round"] = i + 1
            launches.append(r)
            p.save()
    timed = [r for r in launches if not r.get("warmup")]
    p.check("all timed launches succeeded", all(value_ok(r) for r in timed),
            [(r["kind"], r.get("rc"), len(r.get("failures", []))) for r in timed])  # fmt: skip
    table = {}
    for kind in ("ours", "raw"):
        rs = [r for r in timed if r["kind"] == kind and value_ok(r)]
        if not rs:
            continue
        table[kind] = {
            "n": len(rs),
            "wall_result_s": [round(r["wall_result_s"], 3) for r in rs],
            "wall_exit_s": [round(r["wall_exit_s"], 3) for r in rs],
            "steps_per_s": [round(r["value"]["steps_per_s"], 1) for r in rs],
            "final_loss": [r["value"]["final_loss"] for r in rs],
            "median_wall_result_s": statistics.median(r["wall_result_s"] for r in rs),
            "median_wall_exit_s": statistics.median(r["wall_exit_s"] for r in rs),
            "median_steps_per_s": statistics.median(r["value"]["steps_per_s"] for r in rs),
        }
    p.results["table"] = table
    if "ours" in table and "raw" in table:
        o, r = table["ours"], table["raw"]
        p.results["ratio_ours_over_raw"] = {
            k: o[k] / r[k] for k in ("median_wall_result_s", "median_wall_exit_s", "median_steps_per_s")
        }
        losses = {x for k in ("ours", "raw") for x in table[k]["final_loss"]}
        p.check("same final loss in every timed launch (same seeds, same function)",
                max(losses) - min(losses) <= 1e-3 * max(1.0, abs(max(losses))), sorted(losses))  # fmt: skip
    p.save()


def failure_checks(p: Parent) -> None:
    gpu = not p.args.cpu_smoke
    r = p.launch("ours", "--no-gpu-resource")
    fs = r.get("failures") or []
    msg = fs[0].get("message") if fs else None
    p.check(
        "failure: use_gpu=True, resources() without 'gpu' -> our RuntimeError reaches the driver",
        len(fs) == 1 and fs[0].get("rank") is None and fs[0].get("exc_type") == "RuntimeError"
        and "use_gpu=True but Spark assigned this task no GPU" in (msg or "") and not r.get("value"),
        {"failures": fs, "task_results": r.get("task_results")},
    )  # fmt: skip
    p.results["failure_no_gpu"] = r
    how = "oom" if gpu else "raise"
    r = p.launch("ours", "--fail", how)
    fs = r.get("failures") or []
    f0 = fs[0] if fs else {}
    want = ("OutOfMemoryError", "CUDA out of memory") if gpu else ("ValueError", "planted failure in rank 0")
    p.check(
        f"failure: a rank error on the {'GPU (16 TiB cudaMalloc)' if gpu else 'CPU'} comes back as our "
        "RankFailure with the rank's message",
        len(fs) == 1 and f0.get("rank") == 0 and want[0] in (f0.get("exc_type") or "")
        and want[1] in (f0.get("message") or "") and f0.get("exitcode") == 1
        and "train" in (f0.get("traceback") or ""),
        {k: (v[:400] if isinstance(v, str) else v) for k, v in f0.items()},
    )  # fmt: skip
    p.results["failure_rank_error"] = r
    p.save()


def render(p: Parent) -> str:
    res = p.results
    lines = [f"gpu_check ({'CPU smoke, gloo' if p.args.cpu_smoke else 'GPU, NCCL'})"]
    m = res.get("machine", {})
    lines.append(f"nvidia-smi: {m.get('nvidia_smi', '-')}")
    launches = [r for r in res.get("launches", []) if r.get("value")]
    if launches:
        v = launches[0]["value"]
        lines.append(
            f"rank: device {v.get('device_name')} | torch {v.get('torch')} cuda {v.get('cuda')} nccl {v.get('nccl')} "
            f"| model {v.get('params')} params, batch {v.get('batch')}, {v.get('steps_per_window')} steps x "
            f"{len(v.get('window_rates', []))} windows"
        )
    table = res.get("table", {})
    if table:
        lines.append("")
        lines.append(
            f"{'launcher':<34} {'n':>2} {'wall start->result s':>21} {'wall start->exit s':>19} {'steps/s':>9}"
        )
        names = {"ours": "ours (barrier_task, use_gpu=True)", "raw": "raw torchrun --nproc_per_node 1"}
        for kind in ("ours", "raw"):
            if kind in table:
                t = table[kind]
                lines.append(
                    f"{names[kind]:<34} {t['n']:>2} {t['median_wall_result_s']:>21.2f} "
                    f"{t['median_wall_exit_s']:>19.2f} {t['median_steps_per_s']:>9.1f}"
                )
        ratio = res.get("ratio_ours_over_raw")
        if ratio:
            lines.append(
                f"{'ratio ours/raw (medians)':<34} {'':>2} {ratio['median_wall_result_s']:>21.3f} "
                f"{ratio['median_wall_exit_s']:>19.3f} {ratio['median_steps_per_s']:>9.3f}"
            )
        lines.append("")
        for kind in ("ours", "raw"):
            if kind in table:
                t = table[kind]
                lines.append(f"{kind}: wall(result) {t['wall_result_s']}  steps/s {t['steps_per_s']}")
    lines.append("")
    lines.append(
        f"PYTORCH_NVML_BASED_CUDA_CHECK for the timed launches: {res.get('PYTORCH_NVML_BASED_CUDA_CHECK')}"
    )
    for name, value in (res.get("findings") or {}).items():
        lines.append(f"finding {name}: {value}")
    lines.append("")
    for name, c in res.get("checks", {}).items():
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {name}")
    return "\n".join(lines) + "\n"


def parent_main(args: argparse.Namespace) -> int:
    p = Parent(args)
    p.say(f"start: {sys.argv}")
    try:
        machine_facts(p)
        unit_checks(p)
        fork_checks(p)
        main_checks(p)
        failure_checks(p)
    except Exception:  # noqa: BLE001 - keep what was measured
        p.results["error"] = traceback.format_exc()
        p.say(p.results["error"])
    p.results["elapsed_s"] = time.monotonic() - p.t0
    p.save()
    text = render(p)
    (p.out / "gpu_check.txt").write_text(text)
    print(text, flush=True)
    checks = p.results.get("checks", {})
    return 0 if checks and all(c["ok"] for c in checks.values()) and "error" not in p.results else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu-check-out")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: gloo on CPU, tiny model, one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no timed launch after this")
    ap.add_argument("--child", choices=("ours", "raw", "diag"), help=argparse.SUPPRESS)
    ap.add_argument("--diag", choices=("plain", "launchconfig", "launchconfig-nvml"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-nvml-workaround",
        action="store_true",
        help="the script sets no PYTORCH_NVML_BASED_CUDA_CHECK: the launcher, as shipped, must",
    )
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--no-gpu-resource", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fail", choices=("oom", "raise"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "ours":
        child_ours(args)
        return 0
    if args.child == "raw":
        child_raw(args)
        return 0
    if args.child == "diag":
        child_diag(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
