"""Checks on user input, shared by the operator (at DAG parse time and after rendering) and the hook."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spec import MAX_NUM_PROCESSES as MAX_NUM_PROCESSES  # checked here
from airflow_provider_torchdist.submit.staging import check_script_name
from airflow_provider_torchdist.submit.train_module import module_name

#: More ranks than one machine (one Spark task, or the driver in local mode) could sensibly run.
MAX_NPROC_PER_NODE = 1024
#: The longest timeout accepted, in seconds (a week): each bounds a wait that means something is wrong.
MAX_TIMEOUT_S = 7 * 24 * 3600
_ASCII_INT = re.compile(r"-?[0-9]+")
ASCII_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def is_template(value: Any) -> bool:
    """True for a Jinja string that Airflow renders later: it is checked after rendering."""
    return isinstance(value, str) and "{{" in value


def check_int(value: Any, field: str, minimum: int = 1) -> int:
    """An integer >= ``minimum``; a rendered template like ``"2"`` counts as the integer 2.

    Only ASCII digits: ``str.isdigit()`` and ``int()`` also take ``"２"`` or ``"٣"``, which no one
    types on purpose into a DAG.
    """
    if isinstance(value, str) and _ASCII_INT.fullmatch(value.strip()):
        value = int(value.strip())
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        raise InvalidTrainingConfig(
            f"{field} must be an integer >= {minimum} written with ASCII digits 0-9, got {value!r}"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTrainingConfig(f"{field} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise InvalidTrainingConfig(f"{field} must be an integer >= {minimum}, got {value}")
    return value


def check_at_most(value: int, field: str, maximum: int, why: str) -> int:
    """An upper bound on a checked integer; ``why`` says what the field means and what to do."""
    if value > maximum:
        raise InvalidTrainingConfig(f"{field}={value} is more than {maximum}: {why}")
    return value


def check_timeout(value: Any, field: str, *, integer: bool) -> int | float:
    """Seconds to wait: a finite number > 0 (an integer >= 1 when ``integer``), at most a week.

    NaN, infinity and negative numbers would otherwise reach the driver and make it wait forever,
    or not at all. Strings of ASCII digits (``"300"``, ``"2.5"``) count as the number.
    """
    if isinstance(value, str):
        text = value.strip()
        if _ASCII_INT.fullmatch(text):
            value = int(text)
        elif not integer and ASCII_NUMBER.fullmatch(text):
            value = float(text)
    kind = "a whole number of seconds >= 1" if integer else "a finite number of seconds > 0"
    numeric = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value) or value <= 0:
        raise InvalidTrainingConfig(f"{field} must be {kind}, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise InvalidTrainingConfig(
            f"{field} must be at most {MAX_TIMEOUT_S} seconds (a week), got {value!r}: it bounds a wait "
            "that means something is wrong, and a longer one would hide a hung run."
        )
    return value if integer else float(value)


def check_bool(value: Any, field: str) -> bool:
    """A bool; a rendered template like ``"True"`` or ``"false"`` counts as the bool."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise InvalidTrainingConfig(f"{field} must be True or False, got {value!r}")
    return value


def check_train_object(value: Any) -> Callable[..., Any] | str:
    """A callable, ``"-m package.module"``, or the path of a Python script (``str`` or ``os.PathLike``)."""
    if callable(value) or module_name(value) is not None:
        return value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        check_script_name(value)
        return value
    raise InvalidTrainingConfig(
        f"train_object must be a callable or the path of a .py training script, got {type(value).__name__}: "
        f"{value!r} (or, for module mode, '-m package.module')"
    )


_RANGE = re.compile(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*")


def world_size_bounds(value: int | str) -> tuple[int, int]:
    """``(MIN, MAX)`` of a checked ``num_processes``: ``(n, n)`` for a fixed world size."""
    if isinstance(value, str):
        low, high = value.split(":")
        return int(low), int(high)
    return value, value


def check_world_size(value: Any, field: str = "num_processes") -> int | str:
    """A fixed world size (an integer >= 1, as :func:`check_int` takes it) or an elastic range
    ``"MIN:MAX"`` with 1 <= MIN <= MAX, normalized: ``" 2 : 4 "`` becomes ``"2:4"``.

    A string without ``:`` is a fixed size (``"4"`` is 4); ``"4:4"`` stays a range (elastic).
    """
    if not (isinstance(value, str) and ":" in value):
        return check_int(value, field)
    usage = (
        f'{field} must be an integer >= 1 or an elastic range "MIN:MAX" of two whole numbers, such as '
        f'"2:4" (train with 2 to 4 ranks) or 4 (a fixed world size); got {value!r}'
    )
    match = _RANGE.fullmatch(value)
    if match is None:
        raise InvalidTrainingConfig(usage)
    low, high = int(match[1]), int(match[2])
    if low < 1:
        raise InvalidTrainingConfig(
            f"{field}={value!r}: MIN must be at least 1 (the fewest ranks the run trains with). "
            f'Use e.g. {field}="1:{max(high, 1)}".'
        )
    if low > high:
        raise InvalidTrainingConfig(
            f"{field}={value!r}: MIN={low} is more than MAX={high}. Write the fewest ranks first: "
            f'{field}="{high}:{low}".'
        )
    return f"{low}:{high}"


def _check_elastic_topology(num_processes: str, nproc_per_node: int, local_mode: bool) -> None:
    """An elastic range needs distributed mode and bounds that are whole numbers of nodes."""
    if local_mode:
        raise InvalidTrainingConfig(
            f"num_processes={num_processes!r} is an elastic range, but local_mode=True runs every rank on "
            "the Spark driver (this Airflow worker), one machine: there is no node to lose or add. "
            "Use local_mode=False to train elastically on a cluster, or a fixed num_processes such as "
            f"{world_size_bounds(num_processes)[1]}."
        )
    low, high = world_size_bounds(num_processes)
    bad = [f"{name}={n}" for name, n in (("MIN", low), ("MAX", high)) if n % nproc_per_node]
    if bad:
        # Round MIN up and MAX down to whole nodes; MAX up instead when that leaves no range.
        fixed_low = -(-low // nproc_per_node) * nproc_per_node
        fixed_high = high - high % nproc_per_node
        if fixed_high <= fixed_low:
            fixed_high = -(-high // nproc_per_node) * nproc_per_node
        raise InvalidTrainingConfig(
            f"num_processes={num_processes!r}: {' and '.join(bad)} "
            f"{'is not a multiple' if len(bad) == 1 else 'are not multiples'} of "
            f"nproc_per_node={nproc_per_node}. Each Spark task runs nproc_per_node ranks, so an elastic "
            f"run grows and shrinks a whole task at a time. Use e.g. "
            f'num_processes="{fixed_low}:{fixed_high}".'
        )


def check_topology(num_processes: Any, nproc_per_node: Any, local_mode: Any) -> tuple[int | str, int, bool]:
    """``num_processes`` is the total (or an elastic ``"MIN:MAX"``, see :func:`check_world_size`);
    in distributed mode it must split evenly across nodes."""
    num_processes = check_world_size(num_processes)
    fixed = isinstance(num_processes, int)
    check_at_most(
        world_size_bounds(num_processes)[1],
        "num_processes" if fixed else "num_processes MAX",
        MAX_NUM_PROCESSES,
        f"more ranks than any Spark cluster could schedule as one {'barrier ' if fixed else ''}stage. "
        "num_processes is the total number of ranks (the world size); give the number you mean.",
    )
    nproc_per_node = check_at_most(
        check_int(nproc_per_node, "nproc_per_node"),
        "nproc_per_node",
        MAX_NPROC_PER_NODE,
        "more ranks than one machine could run. nproc_per_node is the number of ranks per Spark task "
        "(usually the GPUs or cores of one executor); give the number you mean.",
    )
    local_mode = check_bool(local_mode, "local_mode")
    if isinstance(num_processes, str):
        _check_elastic_topology(num_processes, nproc_per_node, local_mode)
        return num_processes, nproc_per_node, local_mode
    if local_mode:
        check_at_most(
            num_processes,
            "num_processes",
            MAX_NPROC_PER_NODE,
            "local_mode=True runs every rank on the Spark driver (this Airflow worker), one machine. "
            "Use local_mode=False to spread the ranks over a cluster, or fewer processes.",
        )
    if not local_mode and num_processes % nproc_per_node:
        raise InvalidTrainingConfig(
            f"num_processes={num_processes} is not divisible by nproc_per_node={nproc_per_node}: "
            "num_processes is the total number of ranks, split evenly across Spark tasks. "
            f"Use e.g. num_processes={num_processes - num_processes % nproc_per_node or nproc_per_node}."
        )
    return num_processes, nproc_per_node, local_mode


def check_args(value: Any, field: str, kind: type) -> Any:
    """``args`` must be a list or tuple and ``kwargs`` a dict (None means empty)."""
    if value is None:
        return kind()
    accepted = (list, tuple) if kind is list else (dict,)
    if not isinstance(value, accepted):
        raise InvalidTrainingConfig(
            f"{field} must be a {kind.__name__}, got {type(value).__name__}: {value!r}"
        )
    if kind is dict and not all(isinstance(k, str) for k in value):
        raise InvalidTrainingConfig(f"{field} keys must be strings, got {list(value)!r}")
    return list(value) if kind is list else dict(value)


def check_deploy_mode(value: Any) -> None:
    """Only client mode: the driver must run on the Airflow worker, where the hook reads its verdict."""
    if str(value or "").strip().lower() == "cluster":
        raise InvalidTrainingConfig(
            "deploy_mode='cluster' is not supported: the driver reports rank 0's value and each "
            "rank's failure to the Airflow worker, so it must run there (client mode). Remove "
            "deploy-mode from the connection or pass deploy_mode='client'."
        )


def check_unencrypted_allowed(conf: Mapping[str, Any] | None, allow_unencrypted: bool) -> None:
    """Refuse to mix an encrypted Spark cluster with torch's unencrypted traffic unless told to."""
    if (
        str((conf or {}).get("spark.ssl.enabled", "false")).strip().lower() == "true"
        and not allow_unencrypted
    ):
        raise InvalidTrainingConfig(
            "spark.ssl.enabled=true, but torch.distributed traffic (gloo/NCCL collectives, the "
            "rendezvous store) and this provider's run channel between ranks and driver are not "
            "encrypted, so training data and gradients would cross the network in the clear. Run on a "
            "network you trust and pass allow_unencrypted=True to accept this."
        )


def _local_dir(value: Any, field: str) -> tuple[str | None, str | None]:
    """``(path, None)`` for a plain path or ``file:///`` URI, ``(None, scheme)`` for another URI.

    A plain path must be absolute: a relative one would depend on the working directory of each
    process that uses it (the Airflow worker, the Spark driver, every rank). ``file://`` URIs are
    read as fsspec (``ObjectStoragePath``) reads them: the rest is the path, nothing is unquoted.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidTrainingConfig(f"{field} must be an absolute path, got {value!r}")
    scheme, sep, rest = value.partition("://")
    if sep and scheme.lower() != "file":
        return None, scheme
    path = rest if sep else value
    if not os.path.isabs(path):
        hint = (
            "Write file:///absolute/path (three slashes; a host name is not supported)"
            if sep
            else "Give an absolute path" + (" (~ is not expanded)" if path.startswith("~") else "")
        )
        raise InvalidTrainingConfig(
            f"{field} {value!r} is not an absolute path: it would depend on the working directory of "
            f"each process that uses it (the Airflow worker, the Spark driver, every rank). {hint}."
        )
    return path, None


def checkpoint_dir_path(value: Any) -> str:
    """The absolute local path ``checkpoint_dir`` names (a path or ``file:///`` URI).

    Other URIs are refused: the checkpoint helpers write and read plain local paths.
    """
    path, scheme = _local_dir(value, "checkpoint_dir")
    if path is None:
        raise InvalidTrainingConfig(
            f"checkpoint_dir {value!r} is a {scheme}:// URI, but the checkpoint helpers (save_checkpoint, "
            "load_latest_checkpoint) read and write local paths. Give an absolute path (on a multi-host "
            "cluster, on storage every host mounts, such as NFS) or a file:/// URI."
        )
    return path


def output_dir_path(value: Any) -> str | None:
    """The absolute local path ``output_path`` names, or None for remote storage (``s3://...``)."""
    return _local_dir(value, "output_path")[0]
