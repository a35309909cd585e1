"""Module mode: ``train_object="-m package.module"`` runs ``python -m package.module *args`` on
every rank, as ``torchrun -m`` does.

The form is exact: ``-m``, one space, a dotted name of Python identifiers. Anything else that
starts with ``-m`` is refused rather than taken for a script path.
"""

from __future__ import annotations

import keyword

from airflow_provider_torchdist.errors import InvalidTrainingConfig

PREFIX = "-m "


def module_name(train_object: object) -> str | None:
    """The module a module-mode ``train_object`` names; None when it is not a ``-m`` string.

    Raises :class:`InvalidTrainingConfig` for a near miss (``"-m"``, ``"-mpkg"``, ``"-m  pkg"``,
    ``"-m pkg.train --lr 1"``, ``"-m pkg/train.py"``)."""
    if not isinstance(train_object, str) or not train_object.startswith("-m"):
        return None
    name = train_object[len(PREFIX) :] if train_object.startswith(PREFIX) else ""
    parts = name.split(".")
    valid = all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)
    if not name or not valid or parts[0] == "__main__":
        raise InvalidTrainingConfig(
            f"train_object {train_object!r} is not module mode: write exactly '-m', one space and a dotted "
            "module name, e.g. '-m mypkg.train' (it runs like torchrun -m mypkg.train), and give the "
            "module's arguments in args=[...]."
        )
    return name
