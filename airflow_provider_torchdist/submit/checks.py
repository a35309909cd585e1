"""The checks of :class:`~airflow_provider_torchdist.spec.TrainingSpec`'s settings, by name.

A setting's field names its check (``check="positive_int"``); :func:`check_all` runs them, then the
checks that involve several settings (topology, the ``spark.ssl`` guard, client deploy mode). The
functions themselves are the shared ones of :mod:`~airflow_provider_torchdist.submit.validation`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spec import SETTINGS, TrainingSpec
from airflow_provider_torchdist.submit.argument_names import unknown_arguments
from airflow_provider_torchdist.submit.checkpoint_settings import (
    check_checkpoint_mode,
    check_resume_from,
    check_retention,
    checkpoint_dir_uri,
)
from airflow_provider_torchdist.submit.stop_settings import (
    check_grace_period,
    check_hang_timeout,
    check_stop_signal,
)
from airflow_provider_torchdist.submit.validation import (
    check_bool,
    check_deploy_mode,
    check_int,
    check_timeout,
    check_topology,
    check_unencrypted_allowed,
    check_world_size,
    is_template,
    output_dir_path,
    world_size_bounds,
)


def _optional_str(value: Any, name: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if not isinstance(value, str):
        raise InvalidTrainingConfig(f"{name} must be a string or None, got {type(value).__name__}: {value!r}")
    return value


def _non_empty_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidTrainingConfig(f"{name} must be a non-empty string, got {value!r}")
    return value


def _str_dict(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidTrainingConfig(f"{name} must be a dict, got {type(value).__name__}: {value!r}")
    if not all(isinstance(k, str) for k in value):
        raise InvalidTrainingConfig(f"{name} keys must be strings, got {list(value)!r}")
    return dict(value)


def _str_list(value: Any, name: str) -> list[str]:
    """A list of non-empty strings; a string is a comma-separated list (as spark-submit takes it)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        value = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise InvalidTrainingConfig(
            f"{name} must be a list of paths (or one comma-separated string), got {value!r}"
        )
    return list(value)


def _log_ranks(value: Any, name: str) -> str | list[int]:
    """``"all"``, or the global ranks shown: a list of ints, or a string of them joined by commas."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return "all"
    parts = value.split(",") if isinstance(value, str) else value
    ok = isinstance(parts, (list, tuple)) and all(
        (type(p) is int and p >= 0) or (isinstance(p, str) and p.strip().isascii() and p.strip().isdigit())
        for p in parts
    )
    if not ok or (isinstance(value, str) and not value.strip()):
        raise InvalidTrainingConfig(
            f'{name} must be "all", a list of global ranks such as [0, 3], or a string such as "0,3" '
            f"(commas only), got {value!r}"
        )
    return sorted({int(p) for p in parts})


def _train_data(value: Any, name: str) -> Any:
    """None, a callable ``fn(spark) -> DataFrame``, or a non-empty query or table name."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise InvalidTrainingConfig(
        f'{name} must be a Spark SQL query ("SELECT ... FROM parquet.`/path`"), a table name '
        f'("db.table") or a callable fn(spark) -> DataFrame, got {type(value).__name__}: {value!r}'
    )


#: A Spark SQL named parameter (``:day``): an identifier.
_PARAMETER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _sql_args(value: Any, name: str) -> dict[str, Any]:
    """Values for a query's ``:name`` parameters: JSON-native scalars (the spec travels as JSON, and
    Spark binds each as a literal of its type)."""
    args = _str_dict(value, name)
    bad_names = [k for k in args if not _PARAMETER_NAME.fullmatch(k)]
    if bad_names:
        raise InvalidTrainingConfig(
            f"{name} keys must be parameter names (letters, digits, _; the query writes :name), got {bad_names!r}"
        )
    bad = {k: v for k, v in args.items() if v is not None and type(v) not in (str, int, float, bool)}
    if bad:
        raise InvalidTrainingConfig(
            f"{name} values must be strings, numbers, booleans or None, which Spark binds as literals; "
            f"got {', '.join(f'{k}={type(v).__name__}' for k, v in bad.items())}. Convert dates and "
            "the like to strings and cast them in the query (DATE(:day))."
        )
    return args


def _args_need_a_query(train_data: Any, args: dict[str, Any]) -> None:
    """``train_data_args`` bind a query's parameters: a table name or a callable has none."""
    from airflow_provider_torchdist.spark.data.shard_plan import is_table_name

    if isinstance(train_data, str) and not is_table_name(train_data):
        return
    what = (
        "not set"
        if train_data is None
        else "a callable (bind values in it: spark.sql(query, args=...))"
        if callable(train_data)
        else f"the table name {train_data!r}"
    )
    raise InvalidTrainingConfig(
        f"train_data_args {sorted(args)} bind the :name parameters of a train_data query, but train_data "
        f'is {what}. Give a query ("SELECT ... WHERE day = :day") or drop train_data_args.'
    )


def _optional_non_negative_int(value: Any, name: str) -> int | None:
    return None if value is None or value == "" else check_int(value, name, minimum=0)


def _env_dict(value: Any, name: str) -> dict[str, str]:
    return {k: str(v) for k, v in _str_dict(value, name).items()}


def _optional_dir(check: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    def run(value: Any, name: str) -> Any:
        if value is None:
            return None
        check(value)  # the form of the path; the directory itself is checked when the task starts
        return value

    return run


#: What ``spark_submit_kwargs`` takes besides ``SparkSubmitHook``'s own arguments.
SUBMIT_KWARGS_EXTRAS = frozenset({"properties_file", "fast_jvm_start", "py_files"})


def _submit_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Only ``SparkSubmitHook``'s own arguments: a misspelled one fails when the DAG is parsed."""
    from airflow_provider_torchdist.submit.plan import submit_hook_arguments

    allowed = submit_hook_arguments() | SUBMIT_KWARGS_EXTRAS
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise unknown_arguments("spark_submit_kwargs (SparkSubmitHook's arguments)", unknown, allowed)
    return kwargs


CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "positive_int": lambda v, n: check_int(v, n, minimum=1),
    "world_size": check_world_size,
    "non_negative_int": lambda v, n: check_int(v, n, minimum=0),
    "bool": check_bool,
    "optional_bool": lambda v, n: None if v is None else check_bool(v, n),
    "int_timeout": lambda v, n: check_timeout(v, n, integer=True),
    "float_timeout": lambda v, n: check_timeout(v, n, integer=False),
    "grace_period": check_grace_period,
    "hang_timeout": check_hang_timeout,
    "stop_signal": check_stop_signal,
    "optional_str": _optional_str,
    "non_empty_str": _non_empty_str,
    "str_dict": _str_dict,
    "env_dict": _env_dict,
    "str_list": _str_list,
    "log_ranks": _log_ranks,
    "train_data": _train_data,
    "sql_args": _sql_args,
    "optional_non_negative_int": _optional_non_negative_int,
    "submit_kwargs": lambda v, n: _submit_kwargs(_str_dict(v, n)),
    "checkpoint_dir": _optional_dir(checkpoint_dir_uri),
    "checkpoint_mode": check_checkpoint_mode,
    "resume_from": check_resume_from,
    "output_path": _optional_dir(output_dir_path),
}


def _templated(value: Any) -> bool:
    """A value that still holds a Jinja template somewhere (a string, or inside a dict)."""
    if isinstance(value, Mapping):
        return any(_templated(v) for v in value.values())
    return is_template(value)


def build_spec(**settings: Any) -> TrainingSpec:
    """A validated spec; raises ``InvalidTrainingConfig`` naming the setting and what to do.

    Example::

        spec = build_spec(num_processes=4, nproc_per_node=2)
    """
    return TrainingSpec(**check_settings(settings, at_parse_time=False))


def check_settings(settings: Mapping[str, Any], *, at_parse_time: bool) -> dict[str, Any]:
    """Every given setting checked and normalized (``"2"`` to ``2``, None to ``{}``), defaults for
    the rest; at parse time, a value that is still a Jinja template is left for after rendering.

    Raises ``InvalidTrainingConfig`` for an unknown setting or a bad value, naming it.
    """
    fields = SETTINGS
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise InvalidTrainingConfig(
            f"Unknown setting(s) {', '.join(map(repr, unknown))}; the settings are: {', '.join(fields)}."
        )
    out: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in settings:
            out[name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
            continue
        value = settings[name]
        if at_parse_time and f.metadata["templated"] and _templated(value):
            out[name] = value  # checked after rendering
            continue
        out[name] = CHECKS[f.metadata["check"]](value, name)
    _check_together(out, at_parse_time)
    return out


def _check_together(s: dict[str, Any], at_parse_time: bool) -> None:
    """The checks that involve several settings; normalizes ``s`` in place."""

    def ready(*names: str) -> bool:
        return not (at_parse_time and any(_templated(s[n]) for n in names))

    if ready("num_processes", "nproc_per_node", "local_mode"):
        s["num_processes"], s["nproc_per_node"], s["local_mode"] = check_topology(
            s["num_processes"], s["nproc_per_node"], s["local_mode"]
        )
    if (
        ready("train_data", "num_processes")
        and s["train_data"] is not None
        and isinstance(s["num_processes"], str)
    ):
        raise InvalidTrainingConfig(
            f"train_data with an elastic num_processes={s['num_processes']!r} is not supported yet: each "
            "rank's shard is cut for one world size, and it cannot follow a resize. Use a fixed "
            "num_processes with train_data, or read the data in the training function."
        )
    if ready("train_data", "train_data_args") and s["train_data_args"]:
        _args_need_a_query(s["train_data"], s["train_data_args"])
    if ready("log_ranks", "num_processes") and s["log_ranks"] != "all":
        # An elastic run's ranks are 0..MAX-1 at its largest: a rank it may reach is a fair choice.
        most = world_size_bounds(s["num_processes"])[1]
        beyond = [r for r in s["log_ranks"] if r >= most]
        if beyond:
            raise InvalidTrainingConfig(
                f"log_ranks names rank(s) {beyond}, but the run has ranks 0..{most - 1} "
                f"(num_processes={s['num_processes']!r})"
            )
    check_retention(s)
    if "deploy_mode" in s["spark_submit_kwargs"]:
        check_deploy_mode(s["spark_submit_kwargs"]["deploy_mode"])
    if "fast_jvm_start" in s["spark_submit_kwargs"]:  # accepted there too, as before it was a setting
        s["fast_jvm_start"] = check_bool(s["spark_submit_kwargs"].pop("fast_jvm_start"), "fast_jvm_start")
    if "py_files" in s["spark_submit_kwargs"] and ready("py_files"):  # merged into the setting
        extra = _str_list(s["spark_submit_kwargs"].pop("py_files"), "spark_submit_kwargs['py_files']")
        s["py_files"] = [*s["py_files"], *extra]
    if isinstance(s["conf"], Mapping) and not is_template(s["conf"].get("spark.ssl.enabled")):
        check_unencrypted_allowed(s["conf"], s["allow_unencrypted"])
