"""The operator's MLflow run (``mlflow_conn_id``): opened at task start, before anything is
submitted, fed while the operator follows the training run, closed with the run's end.

:func:`start_tracking` checks the server and the credentials, finds the run an earlier try of
this task instance created (or creates it: a mapped instance as a child of its sweep's parent),
and logs the params and tags; :class:`TaskTracking` then takes the run's metrics off the follow
loop (:class:`~airflow_provider_torchdist.operators.tracking.metric_log.MetricLog`), tags the Spark
application, and at the end logs the final metrics, the model on request, and the run's status.
Why the task logs, not the ranks: see :mod:`airflow_provider_torchdist.operators.tracking`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from airflow_provider_torchdist.operators.tracking.identity import LOGGED_UNTIL_TAG, identity_of, run_params
from airflow_provider_torchdist.operators.tracking.metric_log import MetricLog, MetricValue
from airflow_provider_torchdist.spec import TrainingSpec

#: XCom keys of the MLflow run: its id, its page (the "MLflow run" extra link's), and a logged model's URI.
MLFLOW_RUN_ID_XCOM_KEY = "mlflow_run_id"
MLFLOW_MODEL_URI_XCOM_KEY = "mlflow_model_uri"

log = logging.getLogger(__name__)


def rendered_map_name(context: Any) -> str | None:
    """``map_index_template`` rendered for this map index (None when it has none, or fails now:
    a template that needs what the task computes is rendered by Airflow after it)."""
    ti = context["ti"]
    if getattr(ti, "map_index", -1) in (-1, None):
        return None
    if name := getattr(ti, "rendered_map_index", None):
        return str(name)
    template = context.get("map_index_template")
    if not template:
        return None
    try:
        return str(ti.task.dag.get_template_env().from_string(template).render(context)) or None
    except Exception:
        return None


class TaskTracking:
    """This task instance's MLflow run while the operator owns the training run."""

    def __init__(self, client: Any, run_id: str, url: str, logged_until: float, describe: str) -> None:
        from mlflow.entities import Metric, RunTag

        self.client, self.run_id, self.url = client, run_id, url
        self._logged_until = logged_until
        self._offered = 0
        self._newest = 0.0  # the newest record offered
        self._metric, self._tag = Metric, RunTag
        #: The Spark application tagged while the run trained (None: not yet).
        self.app_id: str | None = None
        #: A mapped instance's sweep run: marked finished as each trial ends (the last one's stands).
        self.parent_id: str | None = None
        self.metrics = MetricLog(self._send, describe=describe)

    def _send(self, batch: Sequence[MetricValue]) -> None:
        metrics = [self._metric(v.key, v.value, v.timestamp, v.step) for v in batch]
        until = max(v.timestamp for v in batch) / 1000
        self.client.log_batch(self.run_id, metrics=metrics, tags=[self._tag(LOGGED_UNTIL_TAG, repr(until))])

    def follow_metrics(self, history: list[dict[str, Any]]) -> None:
        """The hook's ``on_metrics`` share: the records new since the last call (the history only
        grows while a run is followed), less those an earlier try logged (by their time: reports
        made in the same millisecond are told apart by their place in the history, not by time)."""
        if len(history) < self._offered:  # another, shorter list: only what is newer than offered
            self.restart_follow()
        new, self._offered = history[self._offered :], len(history)
        for record in new:
            at = float(record.get("time") or 0)
            if at > self._logged_until:
                self._newest = max(self._newest, at)
                self.metrics.offer(record)

    def restart_follow(self) -> None:
        """A new follow of the run: its history starts again from the run's status, and what was
        offered already is skipped by time."""
        self._offered = 0
        self._logged_until = max(self._logged_until, self._newest)

    def application_started(self, app_id: str) -> None:
        """Tag the run with the Spark application's id, off the follow loop (a request may hang)."""
        self.app_id = app_id
        args = ("tag the Spark application", self.client.set_tag, self.run_id, "spark.app_id", app_id)
        threading.Thread(target=self.quietly, args=args, name="torchdist-mlflow-tag", daemon=True).start()

    def finish(self, succeeded: bool, final: dict[str, Any]) -> None:
        """Flush the metrics, log the final ones (``final/<name>``, ``duration_s``) and the status."""
        self.metrics.close()
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [
            Metric(f"final/{k}" if k != "duration_s" else k, float(v), now, 0)
            for k, v in final.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if values:
            self.quietly("log the final metrics", self.client.log_batch, self.run_id, metrics=values)
        status = "FINISHED" if succeeded else "FAILED"
        self.quietly("end the run", self.client.set_terminated, self.run_id, status)
        if self.parent_id:
            self.quietly("end the sweep's run", self.client.set_terminated, self.parent_id, "FINISHED")

    def quietly(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``call(*args, **kwargs)``; a failure is said in the task log as "could not <what>"."""
        try:
            call(*args, **kwargs)
        except Exception as exc:  # tracking never costs the training run
            log.warning("MLflow: could not %s of run %s: %s", what, self.run_id, exc)


def start_tracking(conn_id: str, context: Any, spec: TrainingSpec, args: Any, kwargs: Any) -> TaskTracking:
    """Open this task instance's MLflow run (see the module docstring). Raises
    ``TrackingUnavailable`` when the server does not answer or refuses the credentials."""
    from airflow_provider_torchdist.operators.tracking.connection import connect, load_target
    from airflow_provider_torchdist.operators.tracking.runs import experiment_id, run_url, task_run

    target = load_target(conn_id)
    client = connect(target)
    identity = identity_of(context, rendered_map_name(context))
    experiment = experiment_id(client, target.experiment_name or identity.dag_id)
    run_id, continued = task_run(client, experiment, identity)
    logged = client.get_run(run_id).data
    logged_until = float(logged.tags.get(LOGGED_UNTIL_TAG) or 0.0)
    from mlflow.entities import Param, RunTag

    params = [Param(k, v) for k, v in run_params(spec, args, kwargs).items()]
    tags = [RunTag(k, v) for k, v in identity.tags().items()]
    if continued:  # a param cannot change: the first try's stand; a differing one is said once
        changed = sorted(p.key for p in params if p.key in logged.params and logged.params[p.key] != p.value)
        if changed:
            log.warning("MLflow: params %s differ from the first try's; the first try's are kept.", changed)
        params = [p for p in params if p.key not in logged.params]
    for i in range(0, max(len(params), 1), 100):  # MLflow takes at most 100 params a batch
        client.log_batch(run_id, params=params[i : i + 100], tags=tags if i == 0 else [])
    url = run_url(target.uri, experiment, run_id)
    log.info(
        "MLflow: %s run %s%s.",
        "continuing" if continued else "logging to",
        run_id,
        f" ({url})" if url else "",
    )
    tracking = TaskTracking(
        client, run_id, url, logged_until, describe=f"MLflow run {run_id} at {target.uri}"
    )
    tracking.parent_id = logged.tags.get("mlflow.parentRunId") if identity.mapped else None
    return tracking


def open_tracking(
    conn_id: str | None, context: Any, spec: TrainingSpec, args: Any, kwargs: Any, *, required: bool = True
) -> TaskTracking | None:
    """The task's MLflow run when ``conn_id`` is set (its id and page pushed to XCom), else None.
    ``required=False`` (a deferred task resuming: its run has trained already): a server that does
    not answer is said in the task log, and the run's end is not logged, rather than fail the task."""
    if not conn_id:
        return None
    from airflow_provider_torchdist.links import MLFLOW_RUN_XCOM_KEY

    try:
        tracking = start_tracking(conn_id, context, spec, args, kwargs)
    except Exception as exc:
        if required:
            raise
        log.warning("MLflow: the run's end is not logged: %s", exc)
        return None
    context["ti"].xcom_push(key=MLFLOW_RUN_ID_XCOM_KEY, value=tracking.run_id)
    context["ti"].xcom_push(key=MLFLOW_RUN_XCOM_KEY, value=tracking.url)
    return tracking


def open_for(operator: Any, hook: Any, context: Any, *, required: bool = True) -> TaskTracking | None:
    """:func:`open_tracking` with the operator's settings (its work rendered) and its hook's spec."""
    if not operator.mlflow_conn_id:
        return None
    args, kwargs = operator.train_args, operator.train_kwargs
    return open_tracking(operator.mlflow_conn_id, context, hook.spec, args, kwargs, required=required)


def attach(tracking: TaskTracking | None, hook: Any) -> None:
    """Chain the tracking's share onto the hook's ``on_metrics`` and ``on_application``."""
    if tracking is None:
        return
    tracking.restart_follow()
    metrics, application = hook.on_metrics, hook.on_application

    def on_metrics(history: list[dict[str, Any]]) -> None:
        tracking.follow_metrics(history)
        if metrics is not None:
            metrics(history)

    def on_application(links: Any) -> None:
        tracking.application_started(links.app_id)
        if application is not None:
            application(links)

    hook.on_metrics, hook.on_application = on_metrics, on_application


def close_tracking(
    tracking: TaskTracking | None,
    hook: Any,
    context: Any,
    *,
    value: Any = None,
    succeeded: bool,
    log_model: bool = False,
) -> dict[str, Any]:
    """End the run's tracking: the metrics flushed, the final ones, the model (``log_model``, a
    succeeded run's), the status. Returns what the asset event's ``extra`` gets (``mlflow_run_id``,
    ``mlflow_model_uri``); a model that could not be logged is said in the task log, never raised."""
    if tracking is None:
        return {}
    from airflow_provider_torchdist.operators.outlet_events import final_metrics

    if hook.metrics:
        tracking.follow_metrics(hook.metrics)  # the end of a deferred run's history comes at once
    app_id = hook.run_status.app_id if hook.run_status is not None else None
    if app_id and tracking.app_id is None:  # no application event reached this owner (a deferred run's)
        tracking.app_id = app_id
        tracking.quietly(
            "tag the Spark application", tracking.client.set_tag, tracking.run_id, "spark.app_id", app_id
        )
    final, _ = final_metrics(hook.metrics or [])
    if hook.run_status is not None:
        final["duration_s"] = hook.run_status.elapsed_s
    extra: dict[str, Any] = {"mlflow_run_id": tracking.run_id}
    if succeeded and log_model:
        try:
            model_uri = log_value_model(tracking, value, hook.spec, context["ti"])
        except Exception as exc:
            log.warning("MLflow: could not log the model to run %s: %s", tracking.run_id, exc, exc_info=True)
            model_uri = None
        if model_uri:
            extra["mlflow_model_uri"] = model_uri
            context["ti"].xcom_push(key=MLFLOW_MODEL_URI_XCOM_KEY, value=model_uri)
    tracking.finish(succeeded, final)
    return extra


def log_value_model(tracking: TaskTracking, value: Any, spec: TrainingSpec, ti: Any) -> str | None:
    """Log rank 0's value (decoded from what went to XCom) or this DAG run's newest checkpoint as
    the model."""
    from airflow_provider_torchdist.operators.checkpoint_registry import run_identity
    from airflow_provider_torchdist.operators.tracking.models import log_trained_model
    from airflow_provider_torchdist.outputs.results import load_output
    from airflow_provider_torchdist.spark.node.checkpoint_store import CheckpointStore
    from airflow_provider_torchdist.submit.checkpoint_storage import storage_options

    model = load_output(value) if value is not None else None
    uri = str(spec.checkpoint_dir) if spec.checkpoint_dir else None
    store = CheckpointStore(uri, storage_options(spec.checkpoint_conn_id, uri)) if uri else None
    return log_trained_model(tracking.client, tracking.run_id, model, store, run_identity(ti))


def default_mlflow_conn_id(conn_id: str | None) -> str | None:
    """``mlflow_conn_id``, else ``[torchdist] mlflow_conn_id``; with one set (a template too), the
    MLflow client must be installed: checked here, when the DAG is parsed."""
    if conn_id is None:
        from airflow.providers.common.compat.sdk import conf

        conn_id = (conf.get("torchdist", "mlflow_conn_id", fallback="") or "").strip() or None
    if conn_id:
        from airflow_provider_torchdist.operators.tracking.connection import require_mlflow

        require_mlflow(f"mlflow_conn_id={conn_id!r}")
    return conn_id
