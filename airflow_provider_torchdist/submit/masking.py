"""Which settings are secrets, registered with Airflow's log masker so the task log never shows them."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from airflow.providers.common.compat.sdk import mask_secret

#: Setting names whose values are masked in the task log: passwords, tokens, keys (S3's
#: ``fs.s3a.secret.key``, Azure's ``fs.azure.account.key.<account>...`` and SAS tokens, Spark's
#: ``spark.authenticate.secret``, ``WANDB_API_KEY``, ``HF_TOKEN``, ...).
SECRET_NAME = re.compile(
    r"secret|pass(?:word|wd|phrase)|token|credential|private|api[_.-]?key|access[_.-]?key"
    r"|account[_.-]?key|(?:^|[_.-])sas(?:[_.-]|$)",
    re.I,
)
#: A password inside a value: a URL's ``user:password@`` (``postgresql://u:p@db/x``), or a
#: ``password=...`` parameter (``jdbc:...;password=p``, ``...?password=p&...``).
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?P<userinfo>[^/?#@\s:]*:(?P<password>[^/?#\s]+))@")
_PASSWORD_PARAM = re.compile(r"(?<![A-Za-z0-9])(?:password|passwd|pwd)=(?P<password>[^&;\s]+)", re.I)


def mask_setting_secrets(settings: Mapping[Any, Any]) -> None:
    """Register the secrets among ``settings`` with Airflow's log masker: the value of every setting
    whose name looks secret (:data:`SECRET_NAME`), and any password inside a value (a URL's
    ``user:password@``, a ``password=`` parameter), whatever the setting's name."""
    for name, value in settings.items():
        if value is None:
            continue
        text = str(value)
        if SECRET_NAME.search(str(name)):
            mask_secret(text)
        for match in _URL_USERINFO.finditer(text):
            # user:password too: Airflow skips secrets shorter than 5 characters.
            for secret in (match["userinfo"], match["password"], urllib.parse.unquote(match["password"])):
                mask_secret(secret)
        for match in _PASSWORD_PARAM.finditer(text):
            mask_secret(match["password"])
