"""``python -m airflow_provider_torchdist doctor``: is this environment ready to run training?

Checks, in plain words, what a run needs on this Airflow worker and says what to do about each
missing piece: ``spark-submit``, Spark's jars (``pyspark-client`` has none), Java 17 or newer,
torch (local mode trains here), the output signing key, what the installed Airflow offers, and
the Spark connection a run would use (``spark_default``: defined or the embedded master, and for a
standalone master whether it and its web UI answer).
Nothing is changed: a missing signing key is reported as "made on the first run".

``doctor --connect`` checks a worker that only runs over Spark Connect (a ``spark_connect``
connection): it needs the Connect client (``pyspark-client`` is enough), not spark-submit, the
jars, Java or torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIN_JAVA = 17
#: The one command that gives the embedded default what it needs (pyproject.toml's ``spark`` extra).
INSTALL_SPARK = "pip install 'airflow-provider-torchdist[spark]'"


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str
    detail: str


def _spark_submit() -> Finding:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("spark-submit", path=path)
    if found:
        return Finding(True, "spark-submit", found)
    return Finding(
        False,
        "spark-submit",
        "not found next to this Python or on PATH: install the full pyspark (it ships spark-submit), "
        f"e.g. {INSTALL_SPARK}, or put Spark's bin/ on PATH.",
    )


def _spark_jars() -> Finding:
    home = os.environ.get("SPARK_HOME")
    if not home:
        spec = importlib.util.find_spec("pyspark")
        if spec is None or not spec.submodule_search_locations:
            return Finding(False, "Spark jars", f"pyspark is not installed: {INSTALL_SPARK}.")
        home = list(spec.submodule_search_locations)[0]
    jars = sorted(Path(home, "jars").glob("spark-core_*.jar"))
    if jars:
        return Finding(True, "Spark jars", str(jars[0].parent))
    return Finding(
        False,
        "Spark jars",
        f"{home} has no jars/spark-core_*.jar: that is pyspark-client (what the Spark provider pulls), "
        f"not the full pyspark. Install the full one beside it: {INSTALL_SPARK}, "
        "or set SPARK_HOME to a Spark install.",
    )


def _spark_versions() -> Finding:
    """pyspark's Python files, its jars and pyspark-client must be one Spark release.

    The Spark provider pulls ``pyspark-client``, which writes into the same ``pyspark/`` folder as
    the full ``pyspark``: of different releases, whichever was installed last wins the shared
    files, and Python and JVM sides of Spark disagree.
    """
    from importlib.metadata import PackageNotFoundError, version

    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return Finding(False, "Spark versions", f"pyspark is not installed: {INSTALL_SPARK}.")
    folder = Path(list(spec.submodule_search_locations)[0])
    match = re.search(r"__version__[^=]*=\s*['\"]([^'\"]+)['\"]", (folder / "version.py").read_text())
    python_side = match.group(1) if match else "?"
    found = {"pyspark/version.py": python_side}
    jar = next(iter(sorted(folder.glob("jars/spark-core_*.jar"))), None)
    if jar is not None:
        found["jars"] = jar.stem.rsplit("-", 1)[-1]
    for dist in ("pyspark", "pyspark-client"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if len(set(found.values())) == 1:
        return Finding(True, "Spark versions", f"{python_side} ({', '.join(found)})")
    return Finding(
        False,
        "Spark versions",
        "pyspark/ mixes Spark releases ("
        + ", ".join(f"{k} {v}" for k, v in found.items())
        + "): install pyspark and pyspark-client of the same release, e.g. "
        + INSTALL_SPARK
        + ".",
    )


def _java() -> Finding:
    java = shutil.which(
        "java", path=os.path.join(os.environ["JAVA_HOME"], "bin") if os.environ.get("JAVA_HOME") else None
    )
    if not java:
        return Finding(
            False,
            "Java",
            f"no java on PATH (or in JAVA_HOME): install Java {MIN_JAVA}, e.g. apt-get install openjdk-17-jre-headless.",
        )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding(False, "Java", f"{java} -version failed: {exc}")
    match = re.search(r'version "(\d+)', out.stderr + out.stdout)
    major = int(match.group(1)) if match else 0
    if major >= MIN_JAVA:
        return Finding(True, "Java", f"{java} (Java {major})")
    return Finding(False, "Java", f"{java} is Java {major or '?'}; Spark 4 needs Java {MIN_JAVA} or newer.")


def _torch() -> Finding:
    if importlib.util.find_spec("torch") is None:
        return Finding(
            False,
            "torch",
            "not installed in this Python: local mode trains here, and the embedded master's executors "
            "run this Python. Install torch (the CPU build: pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu), or train only on a cluster whose Python has it.",
        )
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Finding(True, "torch", f"{torch.__version__}, {gpus} GPU(s) visible")


def _signing_key() -> Finding:
    """Where the output signing key comes from (a variable, a command, a secrets backend,
    airflow.cfg, the key file), and whether it will do; never the key itself."""
    from airflow_provider_torchdist.outputs.key_sources import SigningKeyError, read_key_option
    from airflow_provider_torchdist.outputs.signing import MIN_KEY_BYTES, _key_file

    try:
        configured = read_key_option("output_signing_key")
    except SigningKeyError as exc:  # a _CMD/_SECRET form that yields nothing, or fails
        return Finding(False, "signing key", str(exc))
    except Exception as exc:  # a failing secrets backend, say
        return Finding(False, "signing key", f"[torchdist] output_signing_key cannot be read: {exc}")
    if configured.value:
        where = configured.source.describe() if configured.source else "[torchdist] output_signing_key"
        ok = len(configured.value.strip().encode()) >= MIN_KEY_BYTES
        return Finding(
            ok, "signing key", f"from {where}" + ("" if ok else ": shorter than 32 bytes, use a longer one.")
        )
    path = _key_file()
    if not path.exists():
        return Finding(
            True,
            "signing key",
            f"{path} is made (0600) on the first run; every worker and triggerer of a deployment needs the same key: set [torchdist] output_signing_key.",
        )
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return Finding(
            False,
            "signing key",
            f"{path} must be a regular file of this user, mode 0600: chown and chmod 600 it.",
        )
    return Finding(True, "signing key", f"from the key file {path} (this machine only)")


def _airflow() -> Finding:
    import airflow
    from packaging.version import Version

    try:
        from airflow.providers.common.compat.sdk import ResumableJobMixin  # noqa: F401
    except ImportError:
        return Finding(
            False,
            "Airflow",
            f"{airflow.__version__} without ResumableJobMixin: upgrade "
            "apache-airflow-providers-common-compat to 1.23.0 or newer.",
        )
    if Version(airflow.__version__).release < (3, 3):
        # Not a problem: runs work, each try submits a new one (durable=True warns it has no effect).
        return Finding(
            True,
            "Airflow",
            f"{airflow.__version__}: no task_state_store, so a retried task starts a new run; durable "
            "reattach needs Airflow 3.3 or newer.",
        )
    return Finding(True, "Airflow", f"{airflow.__version__}: task_state_store for durable reattach")


def _spark_connection() -> Finding:
    """The Spark connection a run would use (``spark_default``, the operator's default), resolved as
    a run resolves it, and whether its master answers (:mod:`~.submit.connection_check`)."""
    from airflow_provider_torchdist.submit.connection_check import check_spark_connection

    ok, detail = check_spark_connection()
    return Finding(ok, "Spark connection", detail)


CHECKS: tuple[Callable[[], Finding], ...] = (
    _spark_submit,
    _spark_jars,
    _spark_versions,
    _java,
    _torch,
    _signing_key,
    _airflow,
    _spark_connection,
)


def _connect_client() -> Finding:
    try:
        import pyspark
        import pyspark.sql.connect.session  # noqa: F401 (grpc, pandas, pyarrow come with it)
    except ImportError as exc:
        return Finding(
            False,
            "Spark Connect client",
            f"cannot import it ({exc}): pip install 'pyspark-client' (the Spark provider pulls it).",
        )
    return Finding(True, "Spark Connect client", f"pyspark {pyspark.__version__}")


#: A worker that only runs over Spark Connect: no spark-submit, jars, Java or torch here.
CONNECT_CHECKS: tuple[Callable[[], Finding], ...] = (
    _connect_client,
    _signing_key,
    _airflow,
    _spark_connection,
)


def run_checks(connect: bool = False) -> list[Finding]:
    findings = []
    for check in CONNECT_CHECKS if connect else CHECKS:
        try:
            findings.append(check())
        except Exception as exc:  # a check that breaks is a finding, not a crash
            findings.append(
                Finding(False, check.__name__.strip("_").replace("_", " "), f"{type(exc).__name__}: {exc}")
            )
    return findings


def main(argv: list[str] | None = None) -> int:
    """Print one line per check; exit 1 when something is missing. ``--connect``: the checks of a
    worker that runs only over Spark Connect."""
    findings = run_checks(connect="--connect" in (argv or []))
    for f in findings:
        print(f"{'ok     ' if f.ok else 'MISSING'} {f.what}: {f.detail}")
    missing = [f for f in findings if not f.ok]
    print("ready to train" if not missing else f"{len(missing)} problem(s): see MISSING above")
    return 1 if missing else 0
