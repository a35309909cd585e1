"""Arguments nobody takes: named, with the closest known name, before anything runs.

The operator, the hook and ``spark_submit_kwargs`` each take a known set of names. A typo
(``num_process=2``) gets one error that names it, says which known argument is closest, and
blames only what the user wrote: ``spark_submit_kwargs`` only when that dict was passed.

Example::

    unknown_arguments("TorchDistributorOperator", ["num_process"], ["num_processes", "pool"])
    # UnknownArgument: TorchDistributorOperator got an unknown argument: num_process (did you
    # mean num_processes?).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable

from airflow_provider_torchdist.errors import UnknownArgument

#: How alike a known name must be to be offered (difflib's ratio; its default, 0.6, offers
#: ``pool`` for ``poll`` and ``num_processes`` for ``num_process``, and little that misleads).
CUTOFF = 0.6


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name``, or None when none is close enough."""
    matches = difflib.get_close_matches(name, sorted(set(known)), n=1, cutoff=CUTOFF)
    return matches[0] if matches else None


def unknown_arguments(
    owner: str, unknown: Iterable[str], known: Iterable[str], *, hint: str = "", list_known: bool = True
) -> UnknownArgument:
    """The error for ``unknown`` names given to ``owner`` (``"TorchDistributorOperator"``,
    ``"spark_submit_kwargs"``...), each with the closest of ``known``; ``hint`` ends the message.
    With ``list_known``, the message lists the known names too (a short list only)."""
    names = sorted(set(unknown))
    known = sorted(set(known))
    described = []
    for name in names:
        near = closest(name, known)
        described.append(f"{name} (did you mean {near}?)" if near else name)
    what = "unknown arguments" if len(names) > 1 else "an unknown argument"
    text = f"{owner} got {what}: {', '.join(described)}."
    if list_known:
        text += f" It takes: {', '.join(known)}."
    return UnknownArgument(f"{text} {hint}".rstrip())


def parameter_names(classes: Iterable[type]) -> set[str]:
    """The named parameters of the ``__init__`` of each of ``classes`` (``*args``/``**kwargs``
    left out): what a class and its bases take by name."""
    names: set[str] = set()
    for cls in classes:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a builtin's __init__
            continue
        names |= {
            p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
        }
    return names


#: Keywords Airflow itself passes to an operator's constructor (``_airflow_mapped_validation_only``
#: when it checks a mapped task's arguments), never the user.
AIRFLOW_INTERNAL_PREFIX = "_airflow"


@functools.cache
def _operator_parameters(cls: type) -> frozenset[str]:
    return frozenset(parameter_names(cls.__mro__))  # once per class: a DAG may build many tasks


def refuse_unknown_operator_arguments(cls: type, given: Iterable[str], task_id: object) -> None:
    """Raise :class:`~airflow_provider_torchdist.errors.UnknownArgument` for names that neither
    ``cls`` nor any of its bases (BaseOperator included) takes: when the DAG file is parsed, with the
    closest known name, instead of BaseOperator's "Invalid arguments were passed"."""
    known = _operator_parameters(cls)
    unknown = [n for n in given if n not in known and not n.startswith(AIRFLOW_INTERNAL_PREFIX)]
    if unknown:
        raise unknown_arguments(
            f"{cls.__name__} (task_id {task_id!r})",
            unknown,
            known,
            hint="The provider's arguments are in its reference (docs/reference.md), the others are "
            "Airflow's BaseOperator ones.",
            list_known=False,
        )
