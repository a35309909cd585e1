"""The MLflow run's identity, tags and params: a retry finds the same run, a clear a new one, and
nothing that looks secret becomes a param."""

from __future__ import annotations

from airflow_provider_torchdist.operators.tracking.identity import KEY_TAG, TaskIdentity, run_params
from airflow_provider_torchdist.spec import TrainingSpec


def identity(**changes) -> TaskIdentity:
    fields = dict(
        dag_id="retrain", run_id="manual__1", task_id="train", map_index=-1, try_number=1, max_tries=2
    )
    return TaskIdentity(**(fields | changes))


def test_a_retry_keeps_the_key_a_clear_or_another_map_index_changes_it() -> None:
    first = identity()
    assert identity(try_number=2).key() == first.key()  # a retry: the same MLflow run
    assert identity(try_number=3, max_tries=4).key() != first.key()  # cleared: Airflow raised max_tries
    assert identity(map_index=0).key() != identity(map_index=1).key()
    assert identity(map_index=0).sweep_key() == identity(map_index=1).sweep_key()  # one parent


def test_tags_name_the_task_instance_and_a_map_index_is_named_by_its_template() -> None:
    tags = identity(map_index=2, try_number=2, log_url="http://airflow/log").tags()
    assert tags[KEY_TAG] == identity(map_index=2).key()
    assert {
        k: tags[k] for k in ("airflow.dag_id", "airflow.task_id", "airflow.map_index", "airflow.try_number")
    } == {
        "airflow.dag_id": "retrain",
        "airflow.task_id": "train",
        "airflow.map_index": "2",
        "airflow.try_number": "2",
    }
    assert tags["airflow.log_url"] == "http://airflow/log"
    assert identity(map_index=2, map_name="lr=0.1").run_name() == "lr=0.1"
    assert identity(map_index=2).run_name() == "train[2]"


def test_params_flatten_args_kwargs_and_conf_less_secrets() -> None:
    spec = TrainingSpec(
        num_processes=4,
        nproc_per_node=2,
        local_mode=False,
        train_data="SELECT * FROM t",
        conf={
            "spark.executor.memory": "2g",
            "spark.hadoop.fs.s3a.secret.key": "hunter2-secret",
            "spark.jdbc.url": "postgresql://u:pw@db/x",
        },
    )
    params = run_params(spec, [0.1, {"depth": 3}], {"epochs": 3, "opt": {"name": "adam"}, "api_key": "k"})
    assert params["args.0"] == "0.1" and params["args.1.depth"] == "3"
    assert params["kwargs.epochs"] == "3" and params["kwargs.opt.name"] == "adam"
    assert params["num_processes"] == "4" and params["world_size"] == "4" and params["nproc_per_node"] == "2"
    assert params["train_data"] == "SELECT * FROM t"
    assert params["conf.spark.executor.memory"] == "2g"
    assert not any("hunter2" in v or "pw@" in v for v in params.values()), params
    assert "kwargs.api_key" not in params
