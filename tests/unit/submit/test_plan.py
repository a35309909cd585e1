"""The SubmitPlan: every Spark setting merged as spark-submit merges them, the environment, the
connection handed to the Spark provider's hook; planned without starting anything."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from pathlib import Path

import pytest
from airflow.providers.apache.spark.hooks import spark_submit
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.providers.common.compat.sdk import BaseHook

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spark.data.data_shards import SHARED_DIR_CONF
from airflow_provider_torchdist.submit import masking
from airflow_provider_torchdist.submit.checks import build_spec
from airflow_provider_torchdist.submit.connection import (
    SparkTarget,
    connection_in_environment,
    master_url,
    resolve_target,
)
from airflow_provider_torchdist.submit.plan import (
    APP_CONF,
    APP_NAME,
    SPARK_PROPERTIES_FILE,
    SubmitPlan,
    build_plan,
    embedded_authentication,
    spark_properties,
    submit_environment,
    submit_hook_arguments,
    topology_conf,
)
from airflow_provider_torchdist.submit.properties import read_properties
from airflow_provider_torchdist.submit.spark_submit import Submission

SECRET = "plan-secret-0123456789"


def _target(master: str, **fields) -> SparkTarget:
    return SparkTarget(master=master, connection={"conn_type": "spark", "host": master}, **fields)


EMBEDDED = SparkTarget(
    master="local[2]",
    connection={"conn_type": "spark", "host": "local[2]"},
    embedded=True,
    conf={"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"},
)
STANDALONE = _target("spark://h:7077")
YARN = _target("yarn")
K8S = _target("k8s://https://k8s.example.com:443")


@pytest.fixture
def kubernetes_provider(monkeypatch):
    """The Spark provider refuses a k8s master without the cncf.kubernetes provider; it only needs
    its client module to exist for the hook to be built (nothing here talks to a cluster)."""
    monkeypatch.setattr(spark_submit, "kube_client", object(), raising=False)


def _plan(spec, target=EMBEDDED, properties=None, tmp_path=Path("/stage"), env=None) -> SubmitPlan:
    return build_plan(
        spec,
        target,
        application="/stage/torchdist_driver.py",
        application_args=["/stage/spec.json"],
        files=["/stage/payload.pkl"],
        py_files=["/stage/torchdist_spark.zip"],
        properties=properties if properties is not None else {"spark.a": "1"},
        properties_dir=tmp_path,
        env=env if env is not None else {"X": "1"},
    )


# -- the Spark settings, merged ------------------------------------------------------------------


def test_properties_merge_lowest_first_defaults_then_ours_then_conf(tmp_path):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.from.defaults=1\nspark.log.level=DEBUG\nspark.task.cpus=9\nspark.driver.host=10.9.9.9\n"
        "spark.executor.memory=8g\n"
    )
    spec = build_spec(num_processes=4, nproc_per_node=2, conf={"spark.executor.memory": "2g"})
    props = spark_properties(spec, EMBEDDED, None, {"SPARK_CONF_DIR": str(conf_dir)})
    assert props["spark.from.defaults"] == "1"  # spark-defaults.conf: the lowest
    assert props["spark.task.cpus"] == "2"  # the topology beats it
    assert props["spark.log.level"] == APP_CONF["spark.log.level"]  # our defaults too
    assert props["spark.driver.host"] == "127.0.0.1"  # and the target's
    assert props["spark.executor.memory"] == "2g"  # conf beats everything


def test_a_connections_shared_dir_routes_train_data_through_it_and_conf_may_choose_another(monkeypatch):
    conn = {"conn_type": "spark", "host": "spark://m", "port": 7077, "extra": {"shared-dir": "/mnt/shared"}}
    monkeypatch.setenv("AIRFLOW_CONN_SHARED_SPARK", json.dumps(conn))
    target = resolve_target(build_spec(conn_id="shared_spark"))
    assert target.conf == {SHARED_DIR_CONF: "/mnt/shared"}
    assert spark_properties(build_spec(), target, None, {})[SHARED_DIR_CONF] == "/mnt/shared"
    mine = build_spec(conf={SHARED_DIR_CONF: "/mnt/other"})
    assert spark_properties(mine, target, None, {})[SHARED_DIR_CONF] == "/mnt/other"
    for bad in ("relative/dir", 7, ["/mnt"]):
        conn["extra"] = {"shared-dir": bad}
        monkeypatch.setenv("AIRFLOW_CONN_SHARED_SPARK", json.dumps(conn))
        with pytest.raises(InvalidTrainingConfig, match="the extra 'shared-dir' must be the absolute path"):
            resolve_target(build_spec(conn_id="shared_spark"))


def test_spark_defaults_come_from_spark_home_without_a_conf_dir(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").write_text("spark.from.home=1\n")
    props = spark_properties(build_spec(), STANDALONE, str(tmp_path), {})
    assert props["spark.from.home"] == "1"
    assert "spark.from.home" not in spark_properties(build_spec(), STANDALONE, None, {})


def test_a_users_properties_file_replaces_spark_defaults_and_conf_wins_over_it(tmp_path):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text("spark.from.defaults=1\n")
    user_file = tmp_path / "user.conf"
    user_file.write_text("spark.from.file=1\nspark.executor.memory=4g\nspark.log.level=DEBUG\n")
    spec = build_spec(
        conf={"spark.executor.memory": "2g"}, spark_submit_kwargs={"properties_file": str(user_file)}
    )
    props = spark_properties(spec, STANDALONE, None, {"SPARK_CONF_DIR": str(conf_dir)})
    assert "spark.from.defaults" not in props  # spark-submit skips it when given a file
    assert props["spark.from.file"] == "1"
    assert props["spark.executor.memory"] == "2g"
    assert props["spark.log.level"] == APP_CONF["spark.log.level"]


def test_an_unreadable_properties_file_is_refused_naming_it(tmp_path):
    spec = build_spec(spark_submit_kwargs={"properties_file": str(tmp_path / "missing.conf")})
    with pytest.raises(InvalidTrainingConfig, match=r"Cannot read the properties_file '.*missing\.conf'"):
        spark_properties(spec, STANDALONE, None, {})


@pytest.mark.parametrize(
    "target, prefix",
    [(YARN, "spark.yarn.appMasterEnv."), (K8S, "spark.kubernetes.driverEnv.")],
    ids=["yarn", "k8s"],
)
def test_env_vars_become_the_remote_drivers_environment_on_yarn_and_kubernetes(target, prefix):
    spec = build_spec(env_vars={"DB_PASSWORD": SECRET, "N": 1})
    props = spark_properties(spec, target, None, {})
    assert props[prefix + "DB_PASSWORD"] == SECRET and props[prefix + "N"] == "1"
    # spark-submit's own environment: the YARN client (HADOOP_CONF_DIR, ...), not a Kubernetes one.
    expected = {"DB_PASSWORD": SECRET, "N": "1"} if prefix.startswith("spark.yarn") else {}
    assert submit_environment(spec, target, props) == expected
    assert not any(k.startswith(prefix) for k in spark_properties(spec, STANDALONE, None, {}))


def test_secrets_among_the_properties_are_masked(monkeypatch, tmp_path):
    found: list[str] = []
    monkeypatch.setattr(masking, "mask_secret", lambda value, *a, **k: found.append(value))
    user_file = tmp_path / "user.conf"
    user_file.write_text("spark.hadoop.fs.s3a.secret.key=from-the-file-secret\n")
    spec = build_spec(
        conf={"spark.ssl.keyPassword": SECRET}, spark_submit_kwargs={"properties_file": str(user_file)}
    )
    spark_properties(spec, STANDALONE, None, {})
    assert {"from-the-file-secret", SECRET} <= set(found)


# -- topology ---------------------------------------------------------------------------------------


def test_topology_conf():
    assert topology_conf(build_spec(num_processes=4, nproc_per_node=2)) == {
        "spark.task.cpus": "2",
        "spark.cores.max": "4",
    }
    assert topology_conf(build_spec(num_processes=4, nproc_per_node=2, use_gpu=True)) == {
        "spark.task.resource.gpu.amount": "2"
    }
    assert topology_conf(build_spec(num_processes=4, local_mode=True)) == {}  # the driver does the work


def test_an_elastic_run_takes_max_cores_and_task_retries_for_its_lost_nodes():
    spec = build_spec(num_processes="2:6", nproc_per_node=2, max_restarts=3)
    assert topology_conf(spec) == {
        "spark.task.cpus": "2",
        "spark.cores.max": "6",  # MAX: the stage at its largest
        "spark.task.maxFailures": "5",  # max_restarts + 2
    }
    gpu = build_spec(num_processes="2:4", nproc_per_node=2, use_gpu=True)
    assert topology_conf(gpu)["spark.task.maxFailures"] == "2"  # the default max_restarts, 0
    assert "spark.task.maxFailures" not in topology_conf(build_spec(num_processes=4, nproc_per_node=2))
    # The user's conf wins.
    mine = build_spec(num_processes="2:4", conf={"spark.task.maxFailures": "10"})
    assert spark_properties(mine, EMBEDDED, None, {})["spark.task.maxFailures"] == "10"
    assert spark_properties(spec, EMBEDDED, None, {})["spark.task.maxFailures"] == "5"


def test_the_embedded_master_has_a_slot_for_each_rank_an_elastic_run_may_take():
    assert resolve_target(build_spec(num_processes="2:6")).master == "local[6]"


# -- Spark's authentication on the embedded master -----------------------------------------------


def test_embedded_authentication_adds_a_fresh_secret_per_plan(monkeypatch):
    found: list[str] = []
    monkeypatch.setattr(masking, "mask_secret", lambda value, *a, **k: found.append(value))
    first, second = embedded_authentication(EMBEDDED, {}), embedded_authentication(EMBEDDED, {})
    assert first["spark.authenticate"] == "true"
    assert len(first["spark.authenticate.secret"]) >= 32
    assert first["spark.authenticate.secret"] != second["spark.authenticate.secret"]
    assert first["spark.authenticate.secret"] in found


@pytest.mark.parametrize(
    "props, expected",
    [
        ({"spark.authenticate": "false"}, {}),
        ({"spark.authenticate.secret": SECRET}, {}),
        ({"spark.authenticate.secret.file": "/s"}, {}),
        ({"spark.authenticate.secret.driver.file": "/s"}, {}),
    ],
)
def test_embedded_authentication_leaves_the_users_choice(props, expected):
    assert embedded_authentication(EMBEDDED, props) == expected


def test_embedded_authentication_keeps_the_users_true_and_skips_clusters():
    added = embedded_authentication(EMBEDDED, {"spark.authenticate": "TRUE"})
    assert added["spark.authenticate"] == "TRUE" and added["spark.authenticate.secret"]
    for target in (STANDALONE, YARN, K8S):
        assert embedded_authentication(target, {}) == {}
    props = spark_properties(build_spec(), EMBEDDED, None, {})
    assert props["spark.authenticate"] == "true" and props["spark.authenticate.secret"]


# -- spark-submit's environment ----------------------------------------------------------------------


def test_submit_environment(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    spec = build_spec(env_vars={"X": 1, "PYSPARK_DRIVER_PYTHON": "/opt/py"})
    env = submit_environment(spec, EMBEDDED, {})
    assert env["PYSPARK_PYTHON"] == sys.executable
    assert env["PYSPARK_DRIVER_PYTHON"] == "/opt/py"  # env_vars win
    assert env["X"] == "1"
    assert env["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert "SPARK_LOCAL_IP" not in submit_environment(spec, STANDALONE, {})
    assert "PYSPARK_PYTHON" not in submit_environment(spec, STANDALONE, {"spark.pyspark.python": "/p"})


# -- the plan --------------------------------------------------------------------------------------


def test_build_plan(tmp_path):
    spec = build_spec(spark_submit_kwargs={"executor_memory": "1g", "properties_file": "/user.conf"})
    plan = _plan(spec, STANDALONE, tmp_path=tmp_path)
    assert plan.application == "/stage/torchdist_driver.py"
    assert plan.application_args == ["/stage/spec.json"]
    assert (plan.files, plan.py_files) == (["/stage/payload.pkl"], ["/stage/torchdist_spark.zip"])
    assert plan.connection == STANDALONE.connection
    assert plan.properties == {"spark.a": "1"} and plan.env == {"X": "1"}
    # The run's own file replaces the user's, which spark_properties merged.
    assert plan.properties_file == str(tmp_path / SPARK_PROPERTIES_FILE)
    assert plan.submit_kwargs == {"executor_memory": "1g", "name": APP_NAME, "spark_binary": "spark-submit"}
    assert _plan(build_spec(spark_submit_kwargs={"name": "mine"})).submit_kwargs["name"] == "mine"


def test_unknown_spark_submit_kwargs_are_refused_with_the_valid_ones():
    with pytest.raises(
        InvalidTrainingConfig,
        match=r"spark_submit_kwargs .* executr_memory \(did you mean executor_memory\?\)",
    ) as e:
        _plan(build_spec(spark_submit_kwargs={"executr_memory": "1g"}))
    valid = submit_hook_arguments()
    assert {"executor_memory", "driver_memory", "verbose", "name"} <= valid
    for name in valid:
        assert name in str(e.value)
    # What the plan sets itself is not the user's to give.
    assert not {"conf", "conn_id", "files", "py_files", "application_args", "env_vars"} & valid


def test_submit_plan_round_trips_through_json(tmp_path):
    spec = build_spec(spark_submit_kwargs={"executor_memory": "1g", "verbose": True, "num_executors": 2})
    plan = _plan(spec, STANDALONE, properties={"spark.a": "1", "spark.b": "x y"}, tmp_path=tmp_path)
    text = plan.to_json()
    assert SubmitPlan.from_json(text) == plan
    assert json.loads(text)["connection"] == {"conn_type": "spark", "host": "spark://h:7077"}


# -- the connection, handed to the Spark provider's hook ------------------------------------------


def test_connection_in_environment_leaves_no_connection_behind():
    before = {k for k in os.environ if k.startswith("AIRFLOW_CONN_")}
    connection = {"conn_type": "spark", "host": "spark://h", "port": 7077, "password": SECRET}
    with connection_in_environment(connection) as conn_id:
        conn = BaseHook.get_connection(conn_id)
        assert (conn.conn_type, conn.host, conn.port, conn.password) == ("spark", "spark://h", 7077, SECRET)
    assert {k for k in os.environ if k.startswith("AIRFLOW_CONN_")} == before
    with pytest.raises(RuntimeError, match="boom"), connection_in_environment(connection):
        raise RuntimeError("boom")
    assert {k for k in os.environ if k.startswith("AIRFLOW_CONN_")} == before
    with connection_in_environment(connection) as a, connection_in_environment(connection) as b:
        assert a != b  # one id per use: two runs at once never share one


@pytest.mark.parametrize(
    "connection",
    [
        '{"conn_type": "spark", "host": "local[2]"}',
        "spark://h:7077",
        '{"conn_type": "spark", "host": "spark://h", "port": 7077}',
        "spark://yarn",
        '{"conn_type": "spark", "host": "yarn", "extra": {"queue": "q"}}',
        '{"conn_type": "spark", "host": "k8s://https://k8s.example.com", "port": 443}',
        "k8s://https%3A%2F%2Fk8s.example.com:443",
        '{"conn_type": "torchdist_spark", "host": "spark://h", "port": 7077, '
        '"extra": {"master-web-ui": "http://h:8080"}}',
    ],
    ids=[
        "local[2]",
        "spark-uri",
        "spark-json",
        "yarn-uri",
        "yarn-json",
        "k8s-json",
        "k8s-uri",
        "torchdist_spark",
    ],
)
def test_master_url_agrees_with_spark_submit_hooks_private_connection_resolution(
    connection, monkeypatch, kubernetes_provider, tmp_path
):
    """Upstream seam, on purpose: SparkSubmitHook has no public master, and the master this
    provider resolves (for preflight checks and the embedded master) must be the one it submits to.
    If the Spark provider changes how it reads connections, this fails first."""
    monkeypatch.setenv("AIRFLOW_CONN_MY_SPARK", connection)
    target = resolve_target(build_spec(conn_id="my_spark"))
    conn = BaseHook.get_connection("my_spark")
    if conn.conn_type != "torchdist_spark":  # the Spark provider reads its own type only
        assert SparkSubmitHook(conn_id="my_spark")._connection["master"] == target.master
        assert master_url(conn.conn_type, conn.host, conn.port) == target.master
    # The plan's connection, exposed for the hook: the same master.
    with connection_in_environment(target.connection) as conn_id:
        assert SparkSubmitHook(conn_id=conn_id)._connection["master"] == target.master
    plan = _plan(build_spec(conn_id="my_spark"), target, tmp_path=tmp_path, env={})
    assert Submission(plan).make_hook()._connection["master"] == target.master
    assert not any(k.startswith("AIRFLOW_CONN_TORCHDIST_RUN_") for k in os.environ)


def test_the_embedded_targets_plan_resolves_to_its_local_master(tmp_path):
    target = resolve_target(build_spec(num_processes=3))
    assert target.embedded and target.master == "local[3]"
    plan = _plan(build_spec(num_processes=3), target, tmp_path=tmp_path)
    # Upstream seam, on purpose: SparkSubmitHook has no public master.
    assert Submission(plan).make_hook()._connection["master"] == "local[3]"


def test_make_hook_writes_the_plans_properties_privately(tmp_path):
    props = {"spark.x.secret": SECRET, "spark.odd key=": "a\nb é"}
    plan = _plan(build_spec(), STANDALONE, properties=props, tmp_path=tmp_path)
    hook = Submission(plan).make_hook()
    assert isinstance(hook, SparkSubmitHook)
    path = Path(plan.properties_file)
    assert read_properties(path) == props
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [SPARK_PROPERTIES_FILE]
    assert not any(k.startswith("AIRFLOW_CONN_TORCHDIST_RUN_") for k in os.environ)


def test_concurrent_submissions_each_note_their_own_spark_submit_session(tmp_path):
    """Several runs starting spark-submit at once from one process must not take each other's
    session: a run's teardown ends its session, and a wrong one would kill another run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "spark-submit"
    # The fake notes its PID (the session it leads) in the file named by its last argument, then
    # lives 2 s, as a real spark-submit lives far longer: its session is noted by a watcher that
    # polls, which a loaded machine may not schedule within a shorter life (0.3 s failed once).
    fake.write_text('#!/bin/sh\nfor a; do last="$a"; done\necho $$ > "$last"\nsleep 2\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    submissions = []
    for i in range(6):
        plan = build_plan(
            build_spec(),
            EMBEDDED,
            application="/stage/torchdist_driver.py",
            application_args=[str(tmp_path / f"pid-{i}")],
            files=[],
            py_files=[],
            properties={},
            properties_dir=tmp_path / f"stage-{i}",
            env=env,
        )
        (tmp_path / f"stage-{i}").mkdir()
        submissions.append(Submission(plan))
    threads = [threading.Thread(target=s.run) for s in submissions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, submission in enumerate(submissions):
        assert submission.session == int((tmp_path / f"pid-{i}").read_text())
