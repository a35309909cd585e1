"""A faster start for the Spark driver JVM: a per-user class-data archive and C1-only JIT.

In client mode the driver is the ``SparkSubmit`` JVM that ``spark-submit`` starts on the Airflow
worker. It loads and verifies about 10,000 classes from Spark's jars before the Python driver
runs, and again while the ``SparkContext`` starts: 3 to 5 s of CPU on every run. Two JVM options
cut most of it:

- an AppCDS archive (``-XX:SharedArchiveFile``): the classes come memory-mapped, already parsed
  and verified. Java 17 cannot create one on the fly (``-XX:+AutoCreateSharedArchive`` is Java
  19+), so the first run writes one at exit (``-XX:ArchiveClassesAtExit``) into a temporary file
  and the process that ran spark-submit moves it into a per-user cache (:mod:`~airflow_provider_torchdist.submit.jvm_cache`)
  once the JVM says it wrote all of it;
- ``-XX:TieredStopAtLevel=1``: only the quick C1 compiler, no C2 compile threads competing for
  the CPUs during the start. The driver JVM only schedules here; it does not crunch data. The one
  exception is ``train_data`` on a ``local[...]`` master, whose tasks run in the driver JVM and
  convert every row: C1's code takes about 1.7x as long there, so such a run keeps C2.

The options go to ``SPARK_SUBMIT_OPTS``, which the launcher puts on the driver JVM's command line
before ``spark.driver.defaultJavaOptions`` and ``spark.driver.extraJavaOptions``: the JVM takes
the last of repeated options, so a user's own settings win and none of them is overwritten.

A cached archive that does not fit (another JDK build, changed jars) is ignored by the JVM with
``-Xshare:auto``; the only kind it cannot survive, a truncated file, is never installed: the
archive's size is part of its file name and is checked before use.

Example::

    start = plan_driver_jvm_start(cache_root(os.environ), ["java-17", "spark-4.2", "distributed"], "")
    env["SPARK_SUBMIT_OPTS"] = start.spark_submit_opts(env.get("SPARK_SUBMIT_OPTS"))
    ...  # spark-submit runs to its end
    start.finish()  # a first run's archive goes into the cache

The plan carries ``start.pending_archive()``; :class:`~airflow_provider_torchdist.submit.spark_submit.Submission`
installs it when spark-submit ends (:func:`install_pending_archive`), in whichever process runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from airflow_provider_torchdist.submit.jvm_cache import find_archive, private_cache_dir, prune_cache

CACHE_SUBDIR = ("airflow-provider-torchdist", "jvm")
#: Dynamic archives exist since JDK 13, ``-Xlog`` since 9; 17 is what Spark 4 needs and what was tested.
MIN_CDS_JAVA = 17
C1_ONLY = "-XX:TieredStopAtLevel=1"
#: Use an archive when it fits, ignore it when not: never fail the JVM over it (also overrides an
#: ``-Xshare:on`` from ``JAVA_TOOL_OPTIONS``). The CDS warnings of a mismatch or of a first run's
#: dump (hundreds of "Skipping ..." lines) stay out of the task log.
CDS_SAFE = ("-Xshare:auto", "-Xlog:cds*=off")
#: What Java 17 logs (tag ``cds+dynamic``) once a dynamic archive is written and closed.
DUMP_DONE = "Written dynamic archive"
#: Options that mean the user runs class-data sharing their own way: then we add none of ours.
_OWN_CDS = re.compile(
    r"-XX:(SharedArchiveFile|ArchiveClassesAtExit|SharedClassListFile|DumpLoadedClassList)|-Xshare:"
)


def cache_root(environ: Mapping[str, str]) -> Path:
    """Where this user's archives live: ``$XDG_CACHE_HOME`` (default ``~/.cache``)/airflow-provider-torchdist/jvm."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, *CACHE_SUBDIR)


def java_binary(environ: Mapping[str, str]) -> str | None:
    """The ``java`` Spark's ``spark-class`` runs: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    if environ.get("JAVA_HOME"):
        return os.path.join(environ["JAVA_HOME"], "bin", "java")
    return shutil.which("java", path=environ.get("PATH"))


def file_fingerprint(path: str | os.PathLike[str] | None) -> str:
    """``realpath:size:mtime`` of a file or directory (``-`` when missing): changes when it is replaced."""
    if not path:
        return "-"
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return f"{real}:-"
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def java_fingerprint(java: str | None) -> str:
    """The JVM's identity: its binary and ``libjvm.so`` (a JDK update in place replaces the latter)."""
    if not java:
        return "-"
    home = Path(os.path.realpath(java)).parent.parent
    return ";".join(
        file_fingerprint(p) for p in (java, home / "lib" / "server" / "libjvm.so", home / "release")
    )


def java_feature_version(java: str | None) -> int | None:
    """The JDK's feature version (17 for 17.0.15) from its ``release`` file; None when unknown."""
    if not java:
        return None
    release = Path(os.path.realpath(java)).parent.parent / "release"
    try:
        text = release.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r'^JAVA_VERSION="(?:1\.)?(\d+)', text, re.M)
    return int(match.group(1)) if match else None


def archive_key(parts: Sequence[str]) -> str:
    """A short stable name for one JVM + Spark + mode + options combination."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def manages_own_cds(*option_strings: str | None) -> bool:
    """True when the user's JVM options already set up (or switch off) class-data sharing."""
    return any(_OWN_CDS.search(s) for s in option_strings if s)


def merge_java_options(ours: Sequence[str], user: str | None) -> str:
    """Our options first, the user's after them: for a repeated option the JVM takes the last, so theirs win."""
    parts = [*ours]
    if user and user.strip():
        parts.append(user.strip())
    return " ".join(parts)


@dataclass
class DriverJvmStart:
    """The driver JVM options of one run, and (first run) the archive it writes at exit."""

    options: list[str]
    #: Where this run's JVM writes its archive at exit (None: it uses one, or none at all).
    dump_path: Path | None = None
    #: The JVM's ``cds+dynamic`` log of that dump: it says when the archive is complete.
    dump_log: Path | None = None
    #: The cache directory and key the dump is installed under.
    cache: Path | None = None
    key: str | None = None

    def spark_submit_opts(self, user: str | None) -> str:
        """``SPARK_SUBMIT_OPTS`` for spark-submit: ours, then the user's own."""
        return merge_java_options(self.options, user)

    def pending_archive(self) -> dict[str, str] | None:
        """A first run's archive to install when spark-submit ends, as the plan carries it to
        whoever runs spark-submit (:func:`install_pending_archive`); None when there is none."""
        if self.dump_path is None or self.cache is None or self.key is None:
            return None
        return {
            "dump_path": str(self.dump_path),
            "dump_log": str(self.dump_log or ""),
            "cache": str(self.cache),
            "key": self.key,
        }

    def finish(self) -> Path | None:
        """After spark-submit ended: install a first run's archive if the JVM wrote all of it.

        Returns the installed archive. Never raises: a cache problem only costs the speed-up.
        """
        if self.dump_path is None or self.cache is None or self.key is None:
            return None
        installed = None
        try:
            log = self.dump_log.read_text(errors="replace") if self.dump_log else ""
            size = os.stat(self.dump_path).st_size
            if DUMP_DONE in log and size > 0:
                installed = self.cache / f"{self.key}-{size}.jsa"
                os.chmod(self.dump_path, 0o400)
                os.replace(self.dump_path, installed)  # atomic: a concurrent run sees all or nothing
        except OSError:
            installed = None
        for leftover in (self.dump_path, self.dump_log):
            with contextlib.suppress(OSError, TypeError):
                os.unlink(leftover)  # type: ignore[arg-type]
        prune_cache(self.cache, keep=installed)
        return installed


def install_pending_archive(pending: object) -> Path | None:
    """:meth:`DriverJvmStart.finish` for ``pending`` (:meth:`DriverJvmStart.pending_archive`):
    after spark-submit ended, by the process that waited for it. Never raises.

    The plan that carries it is this user's own, but only what a plan of this module could hold is
    acted on: this user's private cache directory, and the dump and log it would have named there
    for the key (so nothing outside that cache is renamed or deleted)."""
    if not isinstance(pending, Mapping):
        return None
    try:
        key, cache = str(pending["key"]), Path(str(pending["cache"]))
        dump, log = Path(str(pending["dump_path"])), Path(str(pending["dump_log"]))
        ours = re.fullmatch(r"[0-9a-f]{24}", key) and private_cache_dir(cache) == cache
        named = re.compile(rf"{key}\.\d+\.[0-9a-f]{{8}}\.jsa\.part")
        tag = dump.name.removesuffix(".jsa.part")
        if not ours or dump.parent != cache or not named.fullmatch(dump.name) or log != cache / f"{tag}.log":
            return None
        return DriverJvmStart([], dump_path=dump, dump_log=log, cache=cache, key=key).finish()
    except Exception:  # a cache problem only costs the speed-up, never the run's own result
        return None


def plan_driver_jvm_start(
    cache: Path | None,
    key_parts: Sequence[str],
    user_options: str | None = None,
    java_version: int | None = MIN_CDS_JAVA,
    c1_only: bool = True,
) -> DriverJvmStart:
    """The driver JVM options for a run: C1 only, plus the cached archive, or the dump of one.

    ``cache`` None (not usable), ``user_options`` that manage class-data sharing themselves, or a
    JDK older than 17 or of unknown version (its JVM would refuse ``-Xlog`` or the archive options
    and not start) leave only C1, which every HotSpot JVM knows. ``c1_only=False``: a driver JVM
    that crunches data keeps the optimizing compiler.
    """
    options = [C1_ONLY] if c1_only else []
    if cache is None or manages_own_cds(user_options) or (java_version or 0) < MIN_CDS_JAVA:
        return DriverJvmStart(options)
    key = archive_key(key_parts)
    archive = find_archive(cache, key)
    prune_cache(cache, keep=archive)
    if archive is not None:
        return DriverJvmStart([*CDS_SAFE, f"-XX:SharedArchiveFile={archive}", *options])
    tag = f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
    dump, log = cache / f"{tag}.jsa.part", cache / f"{tag}.log"
    return DriverJvmStart(
        [
            *CDS_SAFE,
            f"-XX:ArchiveClassesAtExit={dump}",
            f"-Xlog:cds+dynamic=info:file={log}::filecount=0",
            *options,
        ],
        dump_path=dump,
        dump_log=log,
        cache=cache,
        key=key,
    )
