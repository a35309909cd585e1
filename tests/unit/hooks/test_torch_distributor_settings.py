"""TorchDistributorHook's Spark settings: in a private properties file, never on the command line;
what is masked in the log; Spark authentication on the embedded master."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from airflow_provider_torchdist.errors import InvalidTrainingConfig, SparkSubmitFailed
from airflow_provider_torchdist.hooks.torch_distributor import TorchDistributorHook
from airflow_provider_torchdist.submit import masking
from airflow_provider_torchdist.submit.masking import mask_setting_secrets
from airflow_provider_torchdist.submit.plan import SPARK_PROPERTIES_FILE, SubmitPlan
from airflow_provider_torchdist.submit.properties import read_properties
from airflow_provider_torchdist.submit.spark_submit import Submission
from tests.unit.conftest import plan_without_a_run

SECRET = "s3-secret-value-0123456789"


@pytest.fixture
def masked(monkeypatch) -> list[str]:
    """What the provider hands Airflow's log masker."""
    found: list[str] = []
    monkeypatch.setattr(masking, "mask_secret", lambda value, *a, **k: found.append(value))
    return found


@pytest.fixture(autouse=True)
def _no_spark_defaults(monkeypatch, tmp_path_factory):
    """No spark-defaults.conf of the machine's leaks into these tests: an empty conf dir."""
    conf_dir = tmp_path_factory.mktemp("spark-conf-dir")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    return conf_dir


def _plan(hook: TorchDistributorHook, directory: Path, **staged) -> SubmitPlan:
    plan = plan_without_a_run(hook, directory, environ=dict(os.environ), **staged)
    assert Path(plan.properties_file) == directory / SPARK_PROPERTIES_FILE
    return plan


def _written(plan: SubmitPlan) -> dict[str, str]:
    """What ``Submission`` writes to the plan's properties file for spark-submit."""
    Submission(plan).make_hook()
    return read_properties(plan.properties_file)


def _command_line(plan: SubmitPlan) -> list[str]:
    """The command the Spark provider's hook would run for ``plan``."""
    # No public API shows the command SparkSubmitHook runs: its private builder is the only route.
    return Submission(plan).make_hook()._build_spark_submit_command(plan.application)


def _add(a, b=0):
    return a + b


# -- nothing on the command line ----------------------------------------------------------------


def test_no_conf_value_is_on_the_command_line(tmp_path):
    conf = {
        "spark.hadoop.fs.s3a.secret.key": SECRET,
        "spark.executor.memory": "3g-unique-value",
        "spark.driver.extraJavaOptions": "-Dfoo=bar-unique",
    }
    hook = TorchDistributorHook(num_processes=2, conf=conf)
    plan = _plan(hook, tmp_path)
    cmd = _command_line(plan)
    joined = " ".join(cmd)
    assert "--conf" not in cmd
    for key, value in conf.items():
        assert key not in joined and value not in joined
    for key in plan.properties:
        assert key not in joined
    assert plan.properties.items() >= conf.items()
    assert read_properties(plan.properties_file) == plan.properties
    assert cmd[:5] == ["spark-submit", "--master", "local[2]", "--properties-file", plan.properties_file]


def test_the_properties_file_is_private(tmp_path):
    plan = _plan(TorchDistributorHook(conf={"spark.authenticate.secret": SECRET}), tmp_path)
    Submission(plan).make_hook()
    path = Path(plan.properties_file)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SECRET in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [SPARK_PROPERTIES_FILE]  # no partial file left


def test_special_characters_survive_the_file(tmp_path):
    conf = {"spark.x": "  lead\\back=eq:colon #hash é😀\nline", "spark.key:with=odd chars": "v"}
    props = _written(_plan(TorchDistributorHook(conf=conf), tmp_path))
    assert props["spark.x"] == conf["spark.x"]
    assert props["spark.key:with=odd chars"] == "v"


def test_pairs_the_spark_provider_would_add_go_to_the_file_too(monkeypatch, tmp_path):
    # On YARN env_vars become spark.yarn.appMasterEnv.* settings, secrets among them.
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://yarn")
    plan = _plan(TorchDistributorHook(env_vars={"DB_PASSWORD": SECRET}), tmp_path)
    assert plan.properties["spark.yarn.appMasterEnv.DB_PASSWORD"] == SECRET
    assert _written(plan)["spark.yarn.appMasterEnv.DB_PASSWORD"] == SECRET
    cmd = _command_line(plan)
    assert SECRET not in " ".join(cmd) and "--conf" not in cmd


def test_flags_and_options_stay_on_the_command(tmp_path):
    hook = TorchDistributorHook(num_processes=2, verbose=True, executor_memory="1g", name="x")
    plan = _plan(
        hook,
        tmp_path,
        application="/stage/driver.py",
        application_args=("/s/spec.json",),
        files=("/s/p.pkl",),
        py_files=("/s/z.zip",),
    )
    assert plan.submit_kwargs == {
        "verbose": True,
        "executor_memory": "1g",
        "name": "x",
        "spark_binary": "spark-submit",
    }
    cmd = _command_line(plan)
    assert "--verbose" in cmd
    assert cmd[cmd.index("--executor-memory") + 1] == "1g"
    assert cmd[cmd.index("--files") + 1] == "/s/p.pkl"
    assert cmd[cmd.index("--py-files") + 1] == "/s/z.zip"
    assert cmd[-2:] == ["/stage/driver.py", "/s/spec.json"]


# -- merged with the user's properties file and spark-defaults.conf -----------------------------


def test_user_properties_file_is_merged_below_conf(tmp_path):
    user_file = tmp_path / "user.conf"
    user_file.write_text(
        "# the user's own\nspark.executor.memory 4g\nspark.log.level=DEBUG\nspark.only.in.file: yes\n"
    )
    hook = TorchDistributorHook(conf={"spark.executor.memory": "2g"}, properties_file=str(user_file))
    out = tmp_path / "run"
    out.mkdir()
    plan = _plan(hook, out)
    props = plan.properties
    assert props["spark.executor.memory"] == "2g"  # conf beats the file, as --conf does
    assert props["spark.only.in.file"] == "yes"
    assert props["spark.log.level"] == "WARN"  # so do the provider's own settings
    assert "properties_file" not in plan.submit_kwargs  # the run's file replaces it, merged
    cmd = _command_line(plan)
    assert cmd.count("--properties-file") == 1 and str(user_file) not in cmd
    assert hook.spec.spark_submit_kwargs["properties_file"] == str(user_file)  # the setting is kept


def test_spark_defaults_are_merged_lowest_when_no_properties_file(tmp_path, _no_spark_defaults, fake_spark):
    (_no_spark_defaults / "spark-defaults.conf").write_text(
        "spark.eventLog.enabled true\nspark.executor.memory 8g\n"
    )
    hook = TorchDistributorHook(conf={"spark.executor.memory": "2g"}, staging_dir=str(tmp_path))
    hook.run(_add, 1)
    for props in (hook.plan.properties, fake_spark.properties):
        assert props["spark.eventLog.enabled"] == "true"
        assert props["spark.executor.memory"] == "2g"


def test_spark_defaults_are_skipped_with_a_properties_file_as_spark_submit_does(
    tmp_path, _no_spark_defaults, fake_spark
):
    (_no_spark_defaults / "spark-defaults.conf").write_text("spark.eventLog.enabled true\n")
    user_file = tmp_path / "user.conf"
    user_file.write_text("spark.a=1\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    hook = TorchDistributorHook(properties_file=str(user_file), staging_dir=str(staging))
    hook.run(_add, 1)
    assert "spark.eventLog.enabled" not in fake_spark.properties
    assert fake_spark.properties["spark.a"] == "1"


def test_spark_defaults_from_spark_home(monkeypatch, tmp_path, fake_spark):
    monkeypatch.delenv("SPARK_CONF_DIR")
    home = tmp_path / "spark"
    (home / "conf").mkdir(parents=True)
    (home / "conf" / "spark-defaults.conf").write_text("spark.from.home=1\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    hook = TorchDistributorHook(env_vars={"SPARK_HOME": str(home)}, staging_dir=str(staging))
    hook.run(_add, 1)
    assert fake_spark.properties["spark.from.home"] == "1"
    assert hook.plan.env["SPARK_HOME"] == str(home)


def test_unreadable_properties_file_is_refused_before_submitting(tmp_path, no_submit):
    hook = TorchDistributorHook(properties_file=str(tmp_path / "missing.conf"), staging_dir=str(tmp_path))
    with pytest.raises(InvalidTrainingConfig, match="Cannot read the properties_file .*missing.conf"):
        hook.run(_add, 1)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing staged
    assert no_submit == [] and hook.plan is None


def test_during_a_run_the_file_is_in_the_private_staging_directory(tmp_path, fake_spark):
    hook = TorchDistributorHook(num_processes=2, staging_dir=str(tmp_path), conf={"spark.x.secret": SECRET})
    cmd: list[str] = []
    fake_spark.outcome, fake_spark.raises = None, True
    # No public API shows the command SparkSubmitHook runs: its private builder is the only route.
    fake_spark.also = lambda staged: cmd.extend(
        fake_spark.spark_hook._build_spark_submit_command(fake_spark.application)
    )
    with pytest.raises(SparkSubmitFailed):
        hook.run(_add, 1)
    assert hook.plan.properties_file == str(fake_spark.dir / SPARK_PROPERTIES_FILE)
    assert cmd[cmd.index("--properties-file") + 1] == hook.plan.properties_file
    assert fake_spark.modes == (0o700, 0o600)
    props = fake_spark.properties
    assert props == hook.plan.properties
    assert props["spark.x.secret"] == SECRET and props["spark.authenticate"] == "true"
    assert SECRET not in " ".join(cmd) and props["spark.authenticate.secret"] not in " ".join(cmd)
    assert list(tmp_path.iterdir()) == []  # removed with the staging directory
    assert not Path(hook.plan.properties_file).exists()


# -- spark.authenticate on the embedded master --------------------------------------------------


def test_embedded_master_authenticates_with_a_secret_per_run(tmp_path, masked):
    hook = TorchDistributorHook(num_processes=2)
    assert hook.embedded
    first = _plan(hook, tmp_path)
    second = _plan(hook, tmp_path)
    assert first.properties["spark.authenticate"] == "true"
    secret = first.properties["spark.authenticate.secret"]
    assert len(secret) >= 32 and secret != second.properties["spark.authenticate.secret"]
    assert secret in masked
    assert secret not in " ".join(_command_line(first))
    assert "spark.authenticate" not in hook.spec.conf  # only in the run's file


def test_embedded_authentication_respects_the_users_choice(tmp_path):
    off = _plan(TorchDistributorHook(conf={"spark.authenticate": "false"}), tmp_path).properties
    assert off["spark.authenticate"] == "false" and "spark.authenticate.secret" not in off
    own = _plan(TorchDistributorHook(conf={"spark.authenticate.secret": SECRET}), tmp_path).properties
    assert own["spark.authenticate.secret"] == SECRET and "spark.authenticate" not in own
    on = _plan(TorchDistributorHook(conf={"spark.authenticate": "TRUE"}), tmp_path).properties
    assert on["spark.authenticate"] == "TRUE" and on["spark.authenticate.secret"]  # a secret added


def test_cluster_connections_get_no_authentication_of_ours(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://127.0.0.1:7077")
    props = _plan(TorchDistributorHook(), tmp_path).properties
    assert "spark.authenticate" not in props and "spark.authenticate.secret" not in props


# -- masking ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "spark.hadoop.fs.s3a.secret.key",
        "spark.hadoop.fs.s3a.access.key",
        "spark.authenticate.secret",
        "spark.hadoop.fs.azure.account.key.myaccount.dfs.core.windows.net",
        "spark.hadoop.fs.azure.sas.container.account.blob.core.windows.net",
        "spark.hadoop.fs.azure.account.oauth2.client.secret",
        "spark.hadoop.fs.gs.auth.service.account.private.key",
        "spark.ssl.keyStorePassword",
        "spark.ssl.keyPassphrase",
        "WANDB_API_KEY",
        "HF_TOKEN",
        "AZURE_SAS",
        "MY_SECRETS_FILE_CONTENT",
    ],
)
def test_secret_looking_names_are_masked(name, masked):
    TorchDistributorHook(conf={name: SECRET})
    assert SECRET in masked


@pytest.mark.parametrize(
    "name", ["spark.executor.memory", "spark.app.name", "PATH", "spark.sql.shuffle.partitions"]
)
def test_ordinary_names_are_not_masked(name, masked):
    TorchDistributorHook(conf={name: "plain-value"})
    assert "plain-value" not in masked


@pytest.mark.parametrize(
    "value, secrets",
    [
        ("postgresql://alice:hunter2pw@db.example.com:5432/x", ["hunter2pw", "alice:hunter2pw"]),
        (
            "-Ddb=jdbc:mysql://bob:p%40ss%21word@h/db -Dx=1",
            ["p%40ss%21word", "p@ss!word", "bob:p%40ss%21word"],
        ),
        ("https://:tok3n-only@host/path", ["tok3n-only"]),
        ("jdbc:sqlserver://h;user=u;password=Sq1Passw0rd;db=x", ["Sq1Passw0rd"]),
        ("https://host/api?user=u&password=QueryPass1&x=1", ["QueryPass1"]),
        ("-Ddb.password=JavaOptPass -Dx=1", ["JavaOptPass"]),
        ("mongodb://carol:p@ss:w0rd@mongo:27017/db", ["p@ss:w0rd", "carol:p@ss:w0rd"]),
    ],
)
def test_passwords_inside_values_are_masked_whatever_the_name(value, secrets, masked):
    TorchDistributorHook(conf={"spark.some.url": value}, rank_env={"DATABASE_URL": value})
    for secret in secrets:
        assert secret in masked
    assert value not in masked  # the rest of the value stays readable


def test_values_without_passwords_are_not_masked(masked):
    mask_setting_secrets({"URL": "https://user@host/path", "OTHER": "s3a://bucket/key:x", "NONE": None})
    assert masked == []


def test_rank_env_and_env_vars_are_masked_too(masked):
    TorchDistributorHook(
        rank_env={"HF_TOKEN": "hf_rank_token"}, env_vars={"AWS_SECRET_ACCESS_KEY": "aws-key-1"}
    )
    assert {"hf_rank_token", "aws-key-1"} <= set(masked)


def test_secrets_from_the_properties_file_are_masked(tmp_path, masked):
    user_file = tmp_path / "user.conf"
    user_file.write_text("spark.hadoop.fs.s3a.secret.key=from-the-file-secret\n")
    out = tmp_path / "run"
    out.mkdir()
    _plan(TorchDistributorHook(properties_file=str(user_file)), out)
    assert "from-the-file-secret" in masked
