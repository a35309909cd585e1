"""A throwaway PostgreSQL server for the tests: a cluster of its own in a temp dir, on 127.0.0.1.

``start_postgres`` installs the server with ``scripts/install-postgres`` when it is missing (a
missing PostgreSQL fails the test, it is not a skip), runs ``initdb`` and ``postgres`` on a free
port, listening on 127.0.0.1 only, with its unix socket in the temp dir, and creates a database;
``stop_postgres`` stops the server by its pid and checks that none of its processes is left.

PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (``nobody``
where there is none), its temp dir made theirs.

Example::

    server = start_postgres()
    try:
        env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": server.url("postgresql+psycopg2")}
        ...
    finally:
        stop_postgres(server)
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg2
import pytest

from tests.integration.deployment import ROOT, free_port, wait_for

INSTALL_POSTGRES = ROOT / "scripts" / "install-postgres"
HOST = "127.0.0.1"
USER = "airflow"
START_TIMEOUT = 60


@dataclass
class PostgresServer:
    """A running ``postgres`` of our own: its process is ``process`` (the postmaster)."""

    root: Path
    port: int
    database: str
    password: str
    process: subprocess.Popen[bytes]
    #: The postmaster and its children (checkpointer, WAL writer, backends...) seen while it ran.
    seen: dict[int, str] = field(default_factory=dict)

    def url(self, driver: str = "postgresql") -> str:
        """A SQLAlchemy URL for the database (``driver``: e.g. ``postgresql+psycopg2``)."""
        return f"{driver}://{USER}:{self.password}@{HOST}:{self.port}/{self.database}"

    def connect(self) -> psycopg2.extensions.connection:
        return psycopg2.connect(
            host=HOST, port=self.port, user=USER, password=self.password, dbname=self.database
        )

    def log_tail(self, lines: int = 40) -> str:
        log = self.root / "postgres.log"
        text = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
        return "--- postgres.log\n" + "\n".join(text)

    def note_processes(self) -> dict[int, str]:
        """Record the postmaster's live children (backends come and go) in ``seen``; returns them all."""
        with contextlib.suppress(psutil.Error):
            for proc in [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children()]:
                with contextlib.suppress(psutil.Error):
                    self.seen[proc.pid] = " ".join(proc.cmdline()).strip()[:120]
        return self.seen


def server_binaries() -> Path:
    """The folder holding ``initdb`` and ``postgres``, installed with scripts/install-postgres when
    missing; fails the test if that cannot be done."""
    proc = subprocess.run(["bash", str(INSTALL_POSTGRES)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(
            f"PostgreSQL is not installed and scripts/install-postgres failed:\n{proc.stderr[-3000:]}"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def _server_user() -> pwd.struct_passwd | None:
    """Whom the server runs as: ourselves, or, as root (which PostgreSQL refuses), ``postgres``."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    pytest.fail("running as root, and neither a postgres nor a nobody user exists to run PostgreSQL as")


def _as_user(user: pwd.struct_passwd | None) -> dict[str, object]:
    """Popen arguments that run a command as ``user`` (nothing when we are that user)."""
    if user is None:
        return {}
    return {
        "user": user.pw_uid,
        "group": user.pw_gid,
        "extra_groups": [],
        "env": {"PATH": os.defpath, "LC_ALL": "C"},
    }


def start_postgres(database: str = "airflow") -> PostgresServer:
    """A fresh cluster in a temp dir, served on a free port of 127.0.0.1, with ``database`` owned by
    the user ``airflow`` (password auth); returns once it accepts connections."""
    binaries = server_binaries()
    user = _server_user()
    # Not under pytest's tmp_path: its root is private to us, and the server may run as another user.
    root = Path(tempfile.mkdtemp(prefix="postgres-for-tests-"))
    password = secrets.token_hex(16)
    (root / "password").write_text(password)
    if user is not None:
        for path in (root, root / "password"):
            os.chown(path, user.pw_uid, user.pw_gid)
    initdb = subprocess.run(
        [
            str(binaries / "initdb"),
            f"--pgdata={root / 'data'}",
            f"--username={USER}",
            f"--pwfile={root / 'password'}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        **_as_user(user),
    )
    if initdb.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"initdb failed ({initdb.returncode}):\n{initdb.stdout[-2000:]}\n{initdb.stderr[-2000:]}")

    port = free_port()
    with open(root / "postgres.log", "wb") as log:
        process = subprocess.Popen(
            [
                str(binaries / "postgres"),
                "-D",
                str(root / "data"),
                "-c",
                f"listen_addresses={HOST}",
                "-c",
                f"port={port}",
                "-c",
                f"unix_socket_directories={root}",
                # Its log on stderr (postgres.log), for failure messages.
                "-c",
                "logging_collector=off",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **_as_user(user),
        )
    server = PostgresServer(root=root, port=port, database=database, password=password, process=process)

    def accepting() -> bool:
        assert process.poll() is None, f"postgres exited ({process.returncode}):\n{server.log_tail()}"
        try:
            psycopg2.connect(
                host=HOST, port=port, user=USER, password=password, dbname="postgres", connect_timeout=2
            ).close()
        except psycopg2.OperationalError:
            return False
        return True

    try:
        wait_for(accepting, START_TIMEOUT, f"postgres on {HOST}:{port} to accept connections", interval=0.2)
        admin = psycopg2.connect(host=HOST, port=port, user=USER, password=password, dbname="postgres")
        admin.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with contextlib.closing(admin), admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{database}"')
    except BaseException:
        stop_postgres(server)
        raise
    server.note_processes()
    return server


def stop_postgres(server: PostgresServer, timeout: float = 30) -> None:
    """Stop the server by its pid (SIGINT: PostgreSQL's fast shutdown, which ends every session),
    SIGKILL whatever of it is left after ``timeout`` s, remove its temp dir, and fail if any of its
    processes had to be killed."""
    server.note_processes()
    procs = []
    for pid in server.seen:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.process.pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    try:
        server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, deadline - time.monotonic()))
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(timeout=5)
    log = server.log_tail()
    shutil.rmtree(server.root, ignore_errors=True)
    assert not alive, f"postgres processes outlived a fast shutdown by {timeout:.0f} s: {alive}\n{log}"
