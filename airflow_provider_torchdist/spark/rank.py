"""What each rank runs: load the work, call it, forward its output, send back rank 0's value.

Ranks are forked by torchrun's agent from a process that has already imported torch, so a rank
starts in milliseconds. Everything a rank prints goes through :class:`OutputCapture` to the driver.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import os
import queue
import re
import runpy
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_torchdist.spark.channel import ChannelClient, publish_output, rank_prefix
from airflow_provider_torchdist.spark.jobspec import JobSpec
from airflow_provider_torchdist.spark.storage_pickling import dump_output

_PR_SET_PDEATHSIG = 1
_HERE = os.path.dirname(__file__)
_LINE_END = re.compile(r"(\r\n|\r|\n)")

#: This rank's connection to the driver, for ``report()``; None outside a run.
CHANNEL: ChannelClient | None = None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the torchrun agent) dies.

    A rank must never outlive its agent: an orphan keeps holding GPUs and ports.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def rank_thread_count(
    nproc: int, *, environ: Mapping[str, str], task_cpus: int | None, cpus_allowed: int
) -> str | None:
    """The ``OMP_NUM_THREADS`` to give each of a node's ``nproc`` ranks; None keeps what they inherit.

    What the ``torchrun`` command would give them, fitted to the CPUs this node has:

    - a value already in the environment that the user set (the Airflow worker's or ``env_vars``
      in local mode, ``spark.executorEnv.OMP_NUM_THREADS`` on executors) is kept;
    - Spark gives its Python workers ``OMP_NUM_THREADS=spark.task.cpus`` of its own accord: that is
      the whole task's share, which its ranks split (``task_cpus`` is the barrier task's CPU count);
    - unset with several ranks: 1, as torchrun sets; unset with one rank: torch's own default.

    A derived count never exceeds the CPUs this process may run on (``cpus_allowed``, its CPU
    affinity, which executors started under a cpuset or ``taskset`` inherit) split between the ranks.
    Example: Spark's ``OMP_NUM_THREADS=8`` for an 8-CPU task running 4 ranks gives ``"2"`` each.
    """
    preset = environ.get("OMP_NUM_THREADS")
    if task_cpus is not None and preset == str(task_cpus):
        share = min(task_cpus, cpus_allowed)  # Spark's own value: the task's CPUs, split below
    elif preset:
        return None  # the user's choice
    elif nproc > 1:
        return "1"
    else:
        return None
    return str(max(1, share // nproc))


def apply_thread_count(environ: Mapping[str, str] | None = None) -> int | None:
    """Size torch's intra-op thread pool in this rank from its ``OMP_NUM_THREADS``.

    torch reads ``OMP_NUM_THREADS`` once per process. A rank forked from the agent inherits the
    agent's pool, sized when the agent imported torch, before the launcher set the ranks' value:
    without this, two ranks on two cores each ran two threads and trained at a third of the speed.
    Returns the count applied, None when the variable is unset or not a positive integer.
    """
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    try:
        count = int(value)
    except ValueError:
        return None
    if count < 1:
        return None
    import torch  # already imported by the agent this rank forked from

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


class OutputCapture:
    """Sends every line written to fds 1 and 2 (by Python, C code or children) to the driver.

    Lines of any length pass whole. ``\\r`` ends a line too, so progress-bar redraws become
    readable lines instead of one giant line. If the channel breaks, lines go to the original
    stderr instead, after a notice that says so.
    """

    def __init__(self, client: ChannelClient | None, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._fallback_noted = False

    def start(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, name in ((1, "out"), (2, "err")):
            self._saved[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._pump, args=(read_end, name), daemon=True)
            thread.start()
            self._threads.append(thread)
        # Python buffers a pipe in blocks; the log should follow the training as it happens.
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)

    def stop(self, timeout: float = 5.0) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes our pipe's last write end, so the pump sees EOF
        for thread in self._threads:
            thread.join(timeout)
        for saved in self._saved.values():
            os.close(saved)
        self._saved.clear()

    def _emit(self, stream: str, text: str) -> None:
        if self._client is not None and self._client.line(stream, text):
            return
        out = self._saved.get(2)
        if out is None:
            return
        if not self._fallback_noted:
            self._fallback_noted = True
            why = self._client.broken if self._client else "not connected"
            os.write(
                out, f"[torchdist] log channel to the driver is down ({why}); output follows here\n".encode()
            )
        os.write(out, f"{self._prefix} {text}\n".encode(errors="replace"))

    def _pump(self, read_end: int, stream: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        last_redraw = None
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(65536)
                pending += decoder.decode(data or b"", final=not data)
                # Hold a trailing \r back: it may be the first half of \r\n.
                cut = len(pending) - 1 if data and pending.endswith("\r") else len(pending)
                parts = _LINE_END.split(pending[:cut])
                pending = parts.pop() + pending[cut:]
                for text, end in zip(parts[::2], parts[1::2], strict=True):
                    if end == "\r":
                        # A progress-bar redraw: one line per change, not one per refresh.
                        if text and text != last_redraw:
                            self._emit(stream, text)
                        last_redraw = text
                    elif text:
                        self._emit(stream, text)
                if not data:
                    if pending:
                        self._emit(stream, pending)
                    return


def user_traceback(exc: BaseException) -> str:
    """The traceback from the user's first frame on: the frames of this module are noise to them."""
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _HERE:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """The fields of a :class:`RankFailure` that a rank knows about its own exception."""
    if isinstance(exc, SystemExit):
        return {"exc_type": "SystemExit", "message": f"exit code {exc.code}", "exitcode": exc.code}
    return {
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": user_traceback(exc),
    }


def call_entry(spec: JobSpec, entry_path: str) -> Any:
    """Run the user's work in this process: the pickled callable, or the script as ``__main__``."""
    if spec.kind == "callable":
        with open(entry_path, "rb") as f:
            payload = cloudpickle.load(f)
        return payload["fn"](*payload["args"], **payload["kwargs"])
    sys.argv = [entry_path, *spec.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(entry_path)))
    runpy.run_path(entry_path, run_name="__main__")
    return None


def run_rank(
    spec: JobSpec, entry_path: str, channel_address: tuple[str, int], host: str, output_dir: str | None = None
) -> None:
    """The entry point torchrun's agent calls in every rank it forks.

    ``output_dir``: the driver's output directory when this rank runs on the driver's machine (local
    mode): rank 0 then writes its value there itself instead of streaming it over the channel.
    """
    die_with_parent()
    apply_thread_count()
    rank = int(os.environ["RANK"])
    prefix = rank_prefix(rank, host)
    try:
        client: ChannelClient | None = ChannelClient(channel_address, spec.token, rank, host)
    except OSError as exc:
        print(f"[torchdist] {prefix} cannot reach the driver at {channel_address}: {exc}", file=sys.stderr)
        client = None
    global CHANNEL
    CHANNEL = client
    capture = OutputCapture(client, prefix)
    capture.start()
    try:
        value = call_entry(spec, entry_path)
        if rank == 0 and spec.kind == "callable":
            send_output(client, value, output_dir)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            if client:
                client.error(describe_exception(exc))
            raise
    except BaseException as exc:
        sys.stderr.write(user_traceback(exc))
        if client:
            client.error(describe_exception(exc))
        raise
    finally:
        capture.stop()
        if client:
            client.close()


class DigestingWriter:
    """A binary file that also computes the sha256 of everything written to it, in a thread.

    ``hashlib`` releases the GIL on large updates, so the digest of a large pickle is computed on
    another core while the pickler goes on, instead of in a second pass over the file afterwards.
    Chunks are hashed in the order they were written; the queue is bounded, so a slow hash holds the
    writer back rather than piling up memory.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._sha256 = hashlib.sha256()
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._hash, daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._sha256.update(chunk)

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        # The pickler hands over immutable bytes, or tensor memory that stays as it is until the
        # dump ends (and hexdigest() waits for the hash): both are safe to hash a moment later.
        self._chunks.put(data)
        return written

    def hexdigest(self) -> str:
        """Wait for the hash to catch up; the digest of everything written."""
        self._chunks.put(None)
        self._thread.join()
        return self._sha256.hexdigest()


def send_output(client: ChannelClient | None, value: Any, output_dir: str | None = None) -> None:
    """Pickle rank 0's return value and stream it to the driver, which writes it once, atomically.

    The pickle goes to a private temporary file first, tensor memory written as it is
    (:mod:`~airflow_provider_torchdist.spark.storage_pickling`), so pickling costs no second copy of
    the value. Its sha256 is computed while it is written and sent along: the Airflow side signs it
    without reading the file again. With ``output_dir`` (the driver's, on this machine) the file is
    written there and renamed into place: no copy over the channel.
    """
    fd, path = tempfile.mkstemp(prefix=".torchdist-output-", suffix=".pkl", dir=output_dir)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                writer = DigestingWriter(f)
                try:
                    dump_output(value, writer)
                finally:
                    digest = writer.hexdigest()
        except Exception as exc:
            raise TypeError(
                f"rank 0's return value ({type(value).__qualname__}) could not be pickled: {exc}. "
                "Return plain data (numbers, lists, dicts, tensors, state_dicts) instead."
            ) from exc
        if output_dir is not None:
            publish_output(Path(path), Path(output_dir), digest)
            return
        if client is None or not client.output_file(path, sha256=digest):
            why = client.broken if client else "no connection"
            raise ConnectionError(f"rank 0 could not send its return value to the driver: {why}")
    finally:
        if os.path.exists(path):
            os.unlink(path)
