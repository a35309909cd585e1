"""Where a secret ``[torchdist]`` option (``output_signing_key``, ``view_status_key``) comes from.

Airflow's ``conf.get`` resolves it, in Airflow's order: the variable
``AIRFLOW__TORCHDIST__<OPTION>``, its ``_CMD`` form (a command's output), its ``_SECRET`` form (a
config entry of the ``[secrets] backend``), then ``airflow.cfg``'s ``<option>``, ``<option>_cmd``
and ``<option>_secret``. The ``_cmd`` and ``_secret`` forms work only for options declared
``sensitive`` (``get_provider_info()``'s ``config``); undeclared, Airflow skips them silently.

What Airflow does not do, :func:`read_key_option` adds: a ``_CMD`` or ``_SECRET`` form that is set
but yields nothing (a command that prints nothing, a secret the backend does not hold, no backend)
is refused with :class:`SigningKeyError` naming it. Airflow would go on to a later form, and this
provider to its per-machine key file: a key no other machine has, or worse, one the operator did
not mean. For the same reason a ``_CMD``/``_SECRET`` form followed by another form that is set
is refused as ambiguous: Airflow reads the later one whenever the first yields nothing.
"""

from __future__ import annotations

import configparser
import logging
import os
from dataclasses import dataclass

SECTION = "torchdist"


class SigningKeyError(ValueError):
    """The signing key is missing, too short, not private to this user, or configured in a form
    that yields nothing."""


@dataclass(frozen=True)
class KeyForm:
    """One way of setting an option: ``name`` says where (an environment variable or an
    ``airflow.cfg`` entry); ``kind`` is ``value``, ``cmd`` or ``secret``."""

    name: str
    kind: str
    in_env: bool
    entry: str

    def describe(self) -> str:
        """``name`` and how it yields the value: what messages and the doctor show (never the value)."""
        if self.kind == "cmd":
            return f"{self.name} (a command's output)"
        if self.kind == "secret":
            return f"{self.name} (a config entry of the secrets backend {_backend_name()})"
        return self.name


@dataclass(frozen=True)
class ConfiguredKey:
    """An option as Airflow resolved it: ``value`` as it came ("" for none; a blank one from a
    command or a secret is refused) and the form it came from (None when no form is set)."""

    value: str
    source: KeyForm | None


def key_forms(option: str) -> list[KeyForm]:
    """The forms of ``[torchdist] <option>``, in the order Airflow's ``conf.get`` tries them."""
    env = f"AIRFLOW__{SECTION.upper()}__{option.upper()}"
    return [
        KeyForm(env, "value", True, option),
        KeyForm(f"{env}_CMD", "cmd", True, f"{option}_cmd"),
        KeyForm(f"{env}_SECRET", "secret", True, f"{option}_secret"),
        KeyForm(f"[{SECTION}] {option} in airflow.cfg", "value", False, option),
        KeyForm(f"[{SECTION}] {option}_cmd in airflow.cfg", "cmd", False, f"{option}_cmd"),
        KeyForm(f"[{SECTION}] {option}_secret in airflow.cfg", "secret", False, f"{option}_secret"),
    ]


def _declare_options(conf: configparser.RawConfigParser, option: str) -> None:
    """Make sure Airflow knows ``[torchdist] <option>`` is sensitive before it is read.

    From Airflow 3.1 ``conf`` reads providers' declared options on demand. Airflow 3.0 knows them
    only once the providers' configuration is loaded, which its CLI and servers do at start but a
    task's process may not: until then it skips every ``_CMD``/``_SECRET`` form of the option."""
    if (SECTION, option) in conf.sensitive_config_values:  # type: ignore[attr-defined]
        return
    from airflow.providers_manager import ProvidersManager

    # Discovering the providers logs at INFO (to stdout, on 3.0), e.g. hooks whose UI widgets need
    # Flask: routine, and noise in what `python -m airflow_provider_torchdist status-key` prints.
    discovery = logging.getLogger("airflow.providers_manager")
    level = discovery.level
    discovery.setLevel(max(logging.WARNING, level))
    try:
        ProvidersManager().initialize_providers_configuration()
    finally:
        discovery.setLevel(level)


def read_key_option(option: str) -> ConfiguredKey:
    """``[torchdist] <option>`` through Airflow's configuration, refused (:class:`SigningKeyError`)
    when a ``_CMD``/``_SECRET`` form is set but yields nothing, is ambiguous, or fails."""
    from airflow.configuration import conf
    from airflow.exceptions import AirflowConfigException

    _declare_options(conf, option)
    # RawConfigParser's own has_option: airflow.cfg's entries (and conf.set), not the variables or
    # defaults; Airflow's has_option would resolve the option, running its command.
    forms = [
        f
        for f in key_forms(option)
        if (
            f.name in os.environ
            if f.in_env
            else configparser.RawConfigParser.has_option(conf, SECTION, f.entry)
        )
    ]
    indirect = [f for f in forms if f.kind != "value"]
    if forms and forms[0].kind != "value" and len(forms) > 1:
        raise SigningKeyError(
            f"[{SECTION}] {option} is set in more than one way: {', '.join(f.name for f in forms)}. "
            f"Airflow reads the later ones whenever {forms[0].name} yields nothing, so a failing "
            f"{forms[0].kind} would go unnoticed. Keep one of them."
        )
    try:
        value = conf.get(SECTION, option, fallback=None) or ""
    except AirflowConfigException as exc:  # the command failed, the backend failed
        where = " or ".join(f.describe() for f in indirect) or f"[{SECTION}] {option}"
        # Airflow's message goes on with the failed command's output, which may hold the key.
        reason = str(exc).split(" Output: ")[0]
        raise SigningKeyError(f"[{SECTION}] {option} cannot be read from {where}: {reason}") from None
    if not value.strip() and indirect:
        first = indirect[0]
        why = (
            "the command printed nothing"
            if first.kind == "cmd"
            else f"the secrets backend {_backend_name()} has no such entry"
        )
        shadowed = f"; {forms[0].name} is set too, and empty" if forms[0] is not first else ""
        raise SigningKeyError(
            f"{first.name} is set, but [{SECTION}] {option} resolves to nothing ({why}{shadowed}). "
            f"Refusing to go on without the key it names: fix the command or the secret, or unset {first.name}."
        )
    return ConfiguredKey(value, forms[0] if forms else None)


def _backend_name() -> str:
    """The ``[secrets] backend`` class (not its kwargs), or a note that there is none."""
    try:
        from airflow.configuration import conf

        return conf.get("secrets", "backend", fallback="") or "(none is set: [secrets] backend)"
    except Exception:  # only a description: never fail a message for it
        return "(unknown)"
