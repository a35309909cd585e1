"""``python -m airflow_provider_torchdist doctor``: check this environment (see :mod:`.doctor`).

``python -m airflow_provider_torchdist status-key``: print the status-only key for the API
server's ``[torchdist] view_status_key``, derived from this machine's output signing key.
"""

from __future__ import annotations

import sys


def status_key() -> int:
    """Print ``[torchdist] view_status_key`` for this deployment (hex): the Training view's key,
    which asks runs' status and nothing else, so the API server needs no signing key."""
    from airflow_provider_torchdist.outputs.signing import SigningKeyError, signing_key, status_view_key

    try:
        key = signing_key(create=False)
    except SigningKeyError as exc:
        print(f"no status key: {exc}", file=sys.stderr)
        return 1
    print(status_view_key(key).hex())
    return 0


def main(argv: list[str]) -> int:
    if argv == ["status-key"]:
        return status_key()
    if argv not in (["doctor"], ["doctor", "--connect"]):
        print(
            "usage: python -m airflow_provider_torchdist doctor [--connect]\n"
            "       python -m airflow_provider_torchdist status-key",
            file=sys.stderr,
        )
        return 2
    from airflow_provider_torchdist.doctor import main as doctor

    return doctor(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
