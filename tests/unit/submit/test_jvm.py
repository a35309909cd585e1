"""The driver JVM's start options: C1, the per-user class-data archive, merging with user options,
and the hook's launch environment (SPARK_HOME, SPARK_SUBMIT_OPTS). No JVM is started."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.spark.node.daemon import DAEMON_MODULE, PRELOAD_ENV
from airflow_provider_torchdist.submit.fast_start import (
    installed_pyspark_daemon,
    installed_spark_home,
    plan_fast_start,
)
from airflow_provider_torchdist.submit.jvm import (
    C1_ONLY,
    DUMP_DONE,
    archive_key,
    cache_root,
    install_pending_archive,
    java_feature_version,
    java_fingerprint,
    manages_own_cds,
    merge_java_options,
    plan_driver_jvm_start,
)
from airflow_provider_torchdist.submit.jvm_cache import find_archive, private_cache_dir, prune_cache
from airflow_provider_torchdist.submit.plan import submit_environment
from tests.unit.conftest import planned_properties, wait_until

KEY = ["java-a", "spark-b", "distributed", ""]


def test_cache_root_follows_xdg_then_home(tmp_path):
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "airflow-provider-torchdist" / "jvm"
    assert cache_root({}).parts[-3:] == (".cache", "airflow-provider-torchdist", "jvm")


def test_user_options_come_last_so_they_win():
    assert merge_java_options([C1_ONLY], "-XX:TieredStopAtLevel=4 -Xss4m") == (
        f"{C1_ONLY} -XX:TieredStopAtLevel=4 -Xss4m"
    )
    assert merge_java_options([C1_ONLY], None) == C1_ONLY
    assert merge_java_options([C1_ONLY], "  ") == C1_ONLY


@pytest.mark.parametrize(
    "options, own",
    [
        ("-XX:SharedArchiveFile=/x.jsa", True),
        ("-Xshare:off", True),
        ("-Xmx2g -XX:ArchiveClassesAtExit=/y", True),
        ("-Xmx2g -Dfoo=bar", False),
        (None, False),
    ],
)
def test_user_cds_options_are_recognised(options, own):
    assert manages_own_cds(options) is own


def test_key_is_stable_and_tells_combinations_apart():
    assert archive_key(KEY) == archive_key(list(KEY))
    assert archive_key(KEY) != archive_key([*KEY[:2], "local", ""])
    assert len(archive_key(KEY)) == 24


def test_java_fingerprint_changes_when_the_jvm_is_replaced(tmp_path):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "lib" / "server").mkdir(parents=True)
    java, libjvm = home / "bin" / "java", home / "lib" / "server" / "libjvm.so"
    java.write_text("j")
    libjvm.write_text("v1")
    before = java_fingerprint(str(java))
    libjvm.write_text("v2 longer")
    assert java_fingerprint(str(java)) != before
    assert java_fingerprint(None) == "-"


@pytest.mark.parametrize(
    "release, version", [('JAVA_VERSION="17.0.15"', 17), ('JAVA_VERSION="1.8.0_392"', 8), ("", None)]
)
def test_java_feature_version_from_the_release_file(tmp_path, release, version):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "java").write_text("j")
    if release:
        (tmp_path / "release").write_text(f'IMPLEMENTOR="x"\n{release}\n')
    assert java_feature_version(str(tmp_path / "bin" / "java")) == version


@pytest.mark.parametrize("version", [8, 11, None])
def test_older_or_unknown_java_gets_only_c1(tmp_path, version):
    """Java 8 refuses -Xlog and would not start; C1 is known to every HotSpot JVM."""
    assert plan_driver_jvm_start(tmp_path, KEY, java_version=version).options == [C1_ONLY]


def test_first_run_dumps_then_installs_only_a_complete_archive(tmp_path):
    start = plan_driver_jvm_start(tmp_path, KEY)
    assert start.dump_path is not None and start.dump_log is not None
    assert f"-XX:ArchiveClassesAtExit={start.dump_path}" in start.options
    assert "-Xshare:auto" in start.options and C1_ONLY in start.options
    # The JVM wrote the archive and said so at the end of its log.
    start.dump_path.write_bytes(b"x" * 4096)
    start.dump_log.write_text(f"[1.2s][info][cds,dynamic] {DUMP_DONE} 0x8 - 0x9 [984 bytes header]\n")
    installed = start.finish()
    assert installed == tmp_path / f"{archive_key(KEY)}-4096.jsa"
    assert installed.read_bytes() == b"x" * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == [installed.name]  # no leftovers
    # The next run uses it.
    again = plan_driver_jvm_start(tmp_path, KEY)
    assert again.dump_path is None
    assert f"-XX:SharedArchiveFile={installed}" in again.options
    assert again.options.index("-Xshare:auto") < again.options.index(f"-XX:SharedArchiveFile={installed}")


def test_a_dump_the_jvm_did_not_finish_is_thrown_away(tmp_path):
    start = plan_driver_jvm_start(tmp_path, KEY)
    start.dump_path.write_bytes(b"partial")
    start.dump_log.write_text("[1.0s][info][cds,dynamic] Copying 8 klasses\n")  # killed mid-dump
    assert start.finish() is None
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path):
    start = plan_driver_jvm_start(tmp_path, KEY)
    assert start.finish() is None
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_archive_is_never_used(tmp_path):
    """A truncated archive crashes the JVM (SIGBUS): the size in its name must match."""
    archive = tmp_path / f"{archive_key(KEY)}-4096.jsa"
    archive.write_bytes(b"x" * 100)
    assert find_archive(tmp_path, archive_key(KEY)) is None
    start = plan_driver_jvm_start(tmp_path, KEY)
    assert not any("SharedArchiveFile" in o for o in start.options)


def test_prune_removes_killed_runs_dumps_and_old_archives_only(tmp_path):
    now = 10_000_000.0
    files = {
        "k.1.a.jsa.part": now - 2 * 86400,  # a run killed two days ago
        "k.1.a.log": now - 2 * 86400,
        "k.2.b.jsa.part": now - 60,  # a run dumping right now
        "old-1.jsa": now - 40 * 86400,
        "fresh-1.jsa": now - 86400,
        "other.txt": now - 400 * 86400,
    }
    for name, mtime in files.items():
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (mtime, mtime))
    prune_cache(tmp_path, now=now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh-1.jsa", "k.2.b.jsa.part", "other.txt"]


def test_user_cds_settings_leave_only_c1(tmp_path):
    start = plan_driver_jvm_start(tmp_path, KEY, "-Xshare:off")
    assert start.options == [C1_ONLY]
    assert start.finish() is None


def test_no_usable_cache_leaves_only_c1():
    assert plan_driver_jvm_start(None, KEY).options == [C1_ONLY]


def test_cache_dir_is_private_and_quotable(tmp_path):
    cache = private_cache_dir(tmp_path / "c" / "jvm")
    assert cache is not None and (os.stat(cache).st_mode & 0o777) == 0o700
    os.chmod(cache, 0o777)
    assert private_cache_dir(cache) is None  # others could plant an archive
    assert private_cache_dir(tmp_path / "with space") is None


def test_cache_dir_below_a_directory_others_can_write_is_not_used(tmp_path):
    """Another user who can write a directory above the cache can rename the cache away and put a
    directory of their own, with their archive, in its place: the leaf's own mode proves nothing."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, not sticky
    assert private_cache_dir(shared / "me" / "jvm") is None
    assert (os.stat(shared / "me" / "jvm").st_mode & 0o777) == 0o700  # the leaf alone looked private
    os.chmod(shared, 0o770)
    assert private_cache_dir(shared / "me" / "jvm") is None  # group-writable: the same
    os.chmod(shared, 0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    assert private_cache_dir(shared / "me" / "jvm") == shared / "me" / "jvm"


def test_cache_dir_reached_through_a_link_is_checked_where_the_link_leads(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (tmp_path / "home").mkdir(mode=0o755)
    (tmp_path / "home" / "cache").symlink_to(shared)
    assert private_cache_dir(tmp_path / "home" / "cache" / "jvm") is None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a directory to another user needs root (CI runs as root)"
)
def test_cache_dir_below_another_users_directory_is_not_used(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4242, 4242)  # its owner may rename anything in it, whatever its mode
    assert private_cache_dir(theirs / "jvm") is None


def test_missing_parents_are_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        cache = private_cache_dir(tmp_path / "a" / "b" / "jvm")
    finally:
        os.umask(old)
    assert cache == tmp_path / "a" / "b" / "jvm"
    assert [os.stat(p).st_mode & 0o777 for p in (cache.parent.parent, cache.parent, cache)] == [0o700] * 3


# -- the hook's launch environment -----------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("SPARK_HOME", "SPARK_SUBMIT_OPTS", "JAVA_TOOL_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache" / "airflow-provider-torchdist" / "jvm"


def _pyspark_home() -> str:
    import importlib.util

    return os.path.realpath(list(importlib.util.find_spec("pyspark").submodule_search_locations)[0])


def _train():
    return 1


def _run(hook: TorchDistributorHook) -> dict[str, str]:
    """Run ``hook`` with spark-submit faked; the environment its plan gave spark-submit."""
    hook.run(_train)
    return hook.plan.env


def _hook(staging: Path, **settings) -> TorchDistributorHook:
    return TorchDistributorHook(staging_dir=str(staging), **settings)


def test_launch_env_sets_the_jvm_options_and_leaves_spark_home_alone(clean_env, fake_spark, tmp_path):
    hook = _hook(tmp_path)
    env = _run(hook)
    # SPARK_HOME saved 0.03 s a launch when measured again: no longer set (fast_start.py).
    assert "SPARK_HOME" not in env
    options = env["SPARK_SUBMIT_OPTS"].split(" ")
    assert C1_ONLY in options
    dumps = [o.split("=", 1)[1] for o in options if o.startswith("-XX:ArchiveClassesAtExit=")]
    assert len(dumps) == 1 and Path(dumps[0]).parent == clean_env  # a first run writes the archive
    assert list(clean_env.iterdir()) == []  # the fake JVM wrote nothing: nothing is installed or left
    # Planned per run from the configured settings: a second run's options are its own, not added on.
    second = _run(hook)["SPARK_SUBMIT_OPTS"].split(" ")
    assert second.count(C1_ONLY) == 1 and len(second) == len(options)
    assert "SPARK_SUBMIT_OPTS" not in hook.spec.env_vars


def test_the_plan_is_what_plan_fast_start_gives(clean_env, tmp_path):
    hook = TorchDistributorHook(num_processes=2)
    props = planned_properties(hook)
    environ = {**os.environ, **submit_environment(hook.spec, hook.target, props)}
    fast = plan_fast_start(hook.spec, hook.target, environ, props)
    assert fast.jvm is not None and fast.env["SPARK_SUBMIT_OPTS"] == " ".join(fast.jvm.options)
    assert fast.jvm.dump_path is not None and fast.jvm.dump_path.parent == clean_env
    fast.jvm.finish()
    assert list(clean_env.iterdir()) == []


def _jvm_writes_its_archive_at_exit(hook: TorchDistributorHook) -> Callable[[Path], None]:
    """What the driver JVM of a first run does as it exits, after the outcome is out."""

    def stopping(staging: Path) -> None:
        pending = hook.plan.jvm_archive
        assert pending is not None
        Path(pending["dump_path"]).write_bytes(b"x" * 4096)
        Path(pending["dump_log"]).write_text(f"[1.2s][info][cds,dynamic] {DUMP_DONE} 0x8 - 0x9\n")

    return stopping


def test_the_archive_a_first_run_writes_at_exit_is_installed_when_spark_submit_ends(
    clean_env, fake_spark, tmp_path
):
    hook = _hook(tmp_path, num_processes=2)
    fake_spark.stopping = _jvm_writes_its_archive_at_exit(hook)
    _run(hook)
    assert [p.name.endswith("-4096.jsa") for p in clean_env.iterdir()] == [True]  # and no dump left


def test_a_supervised_runs_archive_is_installed_though_its_owner_left_before_the_jvm_ended(
    clean_env, fake_spark, inline_supervisor, tmp_path
):
    """The owner gets the verdict with the driver's outcome; the JVM writes the archive later."""
    hook = _hook(tmp_path, num_processes=2)
    write_archive = _jvm_writes_its_archive_at_exit(hook)
    released = threading.Event()

    def stopping(staging: Path) -> None:
        assert released.wait(10), "the owner never got the verdict"
        write_archive(staging)

    fake_spark.stopping = stopping
    record = hook.start_run(_train, durable=False)
    hook.follow(record, lambda path: released.set())
    wait_until(lambda: any(p.name.endswith(".jsa") for p in clean_env.iterdir()), 10, "the archive")
    supervisor = inline_supervisor[0]
    wait_until(lambda: not supervisor.staging_dir.exists(), 10, "the teardown")
    assert [p.name.endswith("-4096.jsa") for p in clean_env.iterdir()] == [True]


def test_a_pending_archive_is_installed_only_as_this_module_would_have_named_it(clean_env, tmp_path):
    start = plan_driver_jvm_start(tmp_path, KEY)
    start.dump_path.write_bytes(b"x" * 4096)
    start.dump_log.write_text(f"{DUMP_DONE}\n")
    pending = start.pending_archive()
    elsewhere = tmp_path.parent / "someone-elses.log"
    elsewhere.write_text("kept")
    for bad in (
        {**pending, "key": "../../elsewhere"},
        {**pending, "key": ""},
        {**pending, "dump_log": str(elsewhere)},  # a log outside the cache is never deleted
        {**pending, "dump_path": str(tmp_path.parent / "x.jsa.part")},
        {**pending, "cache": str(tmp_path.parent)},
        {k: v for k, v in pending.items() if k != "dump_log"},
        None,
        "not a mapping",
        ["dump_path"],
    ):
        assert install_pending_archive(bad) is None, bad
    assert elsewhere.read_text() == "kept" and start.dump_path.exists()
    assert install_pending_archive(pending) == tmp_path / f"{archive_key(KEY)}-4096.jsa"


def test_users_own_spark_submit_opts_are_kept_and_win(clean_env, monkeypatch, fake_spark, tmp_path):
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", "-Dfrom.env=1")
    env = _run(_hook(tmp_path, env_vars={"SPARK_SUBMIT_OPTS": "-XX:TieredStopAtLevel=4"}))
    assert env["SPARK_SUBMIT_OPTS"].endswith(" -XX:TieredStopAtLevel=4")
    assert C1_ONLY in env["SPARK_SUBMIT_OPTS"]


def test_users_extra_java_options_are_not_touched(clean_env, fake_spark, tmp_path):
    hook = _hook(tmp_path, conf={"spark.driver.extraJavaOptions": "-Xshare:off -Dx=1"})
    env = _run(hook)
    assert hook.plan.properties["spark.driver.extraJavaOptions"] == "-Xshare:off -Dx=1"
    assert fake_spark.properties["spark.driver.extraJavaOptions"] == "-Xshare:off -Dx=1"
    assert env["SPARK_SUBMIT_OPTS"] == C1_ONLY  # they run CDS their way


def test_fast_jvm_start_can_be_switched_off(clean_env, fake_spark, tmp_path):
    hook = _hook(tmp_path, fast_jvm_start=False)
    assert "SPARK_SUBMIT_OPTS" not in _run(hook)
    assert "SPARK_HOME" not in hook.plan.env
    fast = plan_fast_start(hook.spec, hook.target, dict(os.environ), {})
    assert fast.env == {} and fast.jvm is None


def test_spark_home_is_left_alone_when_set_or_for_another_spark_submit(clean_env, fake_spark, tmp_path):
    assert _run(_hook(tmp_path, env_vars={"SPARK_HOME": "/opt/spark"}))["SPARK_HOME"] == "/opt/spark"
    other = tmp_path / "bin"
    other.mkdir()
    (other / "spark3-submit").write_text("#!/bin/sh\n")
    (other / "spark3-submit").chmod(0o755)
    staging = tmp_path / "staging"
    staging.mkdir()
    env = _run(_hook(staging, spark_binary="spark3-submit", env_vars={"PATH": str(other)}))
    assert "SPARK_HOME" not in env
    assert installed_spark_home("spark3-submit", {"PATH": str(other)}) is None
    assert installed_spark_home("spark-submit", {"SPARK_HOME": "/opt/spark"}) is None


@pytest.mark.parametrize("train_data, c1", [(None, True), ("SELECT 1 AS x", False)])
def test_a_local_master_reading_train_data_keeps_the_optimizing_compiler(clean_env, tmp_path, train_data, c1):
    """Its tasks convert every row inside the driver JVM, where C1-only code is much slower."""
    hook = TorchDistributorHook(num_processes=2, train_data=train_data)
    assert hook.target.is_local
    props = planned_properties(hook)
    environ = {**os.environ, **submit_environment(hook.spec, hook.target, props)}
    fast = plan_fast_start(hook.spec, hook.target, environ, props)
    assert fast.jvm is not None and (C1_ONLY in fast.jvm.options) is c1
    assert ("-XX:ArchiveClassesAtExit" in fast.env["SPARK_SUBMIT_OPTS"]) is True  # the archive either way
    fast.jvm.finish()


def test_the_jvm_plan_leaves_c1_only_out_when_asked():
    assert C1_ONLY in plan_driver_jvm_start(None, KEY, c1_only=True).options
    assert plan_driver_jvm_start(None, KEY, c1_only=False).options == []


# -- the executors' Python daemon (fast_start.installed_pyspark_daemon) --------------------------------


def _daemon_conf(hook: TorchDistributorHook, **environ: str) -> dict[str, str]:
    props = planned_properties(hook)
    full = {**os.environ, **submit_environment(hook.spec, hook.target, props), **environ}
    return plan_fast_start(hook.spec, hook.target, full, props).conf


def test_a_local_masters_executors_start_the_daemon_with_the_installed_pyspark(
    clean_env, fake_spark, tmp_path
):
    hook = _hook(tmp_path, num_processes=2)
    assert hook.target.is_local and not hook.spec.local_mode
    preload = f"spark.executorEnv.{PRELOAD_ENV}"
    assert _daemon_conf(hook) == {"spark.python.daemon.module": DAEMON_MODULE, preload: "1"}
    _run(hook)  # it reaches spark-submit's properties
    assert fake_spark.properties["spark.python.daemon.module"] == DAEMON_MODULE
    assert fake_spark.properties[preload] == "1"
    # The module exists and runs pyspark's daemon (the integration tests start it for real).
    assert importlib.util.find_spec(DAEMON_MODULE) is not None


@pytest.mark.parametrize(
    "settings, environ",
    [
        ({"conf": {"spark.python.daemon.module": "my.daemon"}}, {}),  # the user's own daemon
        ({"conf": {"spark.python.use.daemon": "false"}}, {}),  # no daemon at all
        ({"conf": {"spark.pyspark.python": "/opt/py/bin/python"}}, {}),  # executors run another Python
        ({}, {"PYSPARK_PYTHON": "/opt/py/bin/python"}),
        ({"conf": {"spark.executorEnv.PYSPARK_PYTHON": "/opt/py/bin/python"}}, {}),
        ({"fast_jvm_start": False}, {}),  # every acceleration off
        ({}, {"TORCHDIST_FAST_START_OFF": "pyspark"}),  # the benchmarking knob
    ],
)
def test_the_daemon_is_left_as_spark_starts_it(clean_env, tmp_path, settings, environ):
    hook = _hook(tmp_path, num_processes=2, **settings)
    assert _daemon_conf(hook, **environ) == {}


@pytest.mark.parametrize(
    "settings, environ",
    [
        ({"local_mode": True}, {}),  # the ranks train on the driver: no barrier task needs torch
        ({}, {"TORCHDIST_FAST_START_OFF": "torch"}),  # the benchmarking knob
    ],
)
def test_the_daemon_loads_no_torch_where_no_barrier_task_trains(clean_env, tmp_path, settings, environ):
    hook = _hook(tmp_path, num_processes=2, **settings)
    assert _daemon_conf(hook, **environ) == {"spark.python.daemon.module": DAEMON_MODULE}


def test_a_cluster_masters_daemon_is_left_as_spark_starts_it(clean_env, tmp_path):
    """Its executors may run another machine's Python, which need not have this package."""
    hook = _hook(tmp_path, num_processes=2)
    target = dataclasses.replace(hook.target, master="spark://spark-master:7077")
    assert not target.is_local
    assert installed_pyspark_daemon(target, dict(os.environ), {}) == {}
