"""``python -m airflow_provider_torchdist doctor``: check this environment (see :mod:`.doctor`)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv not in (["doctor"], ["doctor", "--connect"]):
        print("usage: python -m airflow_provider_torchdist doctor [--connect]", file=sys.stderr)
        return 2
    from airflow_provider_torchdist.doctor import main as doctor

    return doctor(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
