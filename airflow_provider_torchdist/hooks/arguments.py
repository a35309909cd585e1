"""How :class:`~airflow_provider_torchdist.hooks.torch_distributor.TorchDistributorHook` takes its
settings: which ones, its constructor's signature, and the spec it builds from its arguments.

The hook takes the settings of :class:`~airflow_provider_torchdist.spec.TrainingSpec` that the
run and spark-submit use (not how the operator puts outputs in XCom, how long a run lives apart
from its task, nor what of the task's OpenLineage identity goes to Spark, which needs the task's
context), ``num_processes``, ``local_mode`` and ``use_gpu`` also positionally, and any other
keyword as a ``SparkSubmitHook`` argument.
"""

from __future__ import annotations

import inspect
from typing import Any

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.spec import (
    LINEAGE,
    OWNER,
    RUN,
    SETTINGS,
    SUBMIT,
    TRACKING,
    XCOM,
    TrainingSpec,
    settings_for,
    signature_of,
)
from airflow_provider_torchdist.submit.argument_names import unknown_arguments
from airflow_provider_torchdist.submit.checks import SUBMIT_KWARGS_EXTRAS, build_spec
from airflow_provider_torchdist.submit.plan import submit_hook_arguments

#: The settings the hook takes (the operator's less how outputs travel through XCom).
HOOK_SETTINGS = settings_for(RUN, SUBMIT)
#: The settings the hook also takes positionally, in this order.
POSITIONAL = ("num_processes", "local_mode", "use_gpu")


def hook_signature() -> inspect.Signature:
    """The hook constructor's signature: the positional settings, every other hook setting as a
    keyword, ``spec``, and ``**spark_submit_kwargs``."""
    return signature_of(
        [n for n in HOOK_SETTINGS if n not in POSITIONAL and n != "spark_submit_kwargs"],
        leading=[
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(
                inspect.Parameter(
                    n,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=SETTINGS[n].default,
                    annotation=SETTINGS[n].type,
                )
                for n in POSITIONAL
            ),
        ],
        trailing=[
            inspect.Parameter("spec", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("spark_submit_kwargs", inspect.Parameter.VAR_KEYWORD),
        ],
    )


#: Operator settings the hook refuses, by scope, and what to do instead.
_OPERATOR_ONLY = (
    (
        XCOM,
        "say(s) how the operator puts rank 0's value in XCom; the hook returns the value itself. "
        "Pass it to TorchDistributorOperator instead.",
    ),
    (
        OWNER,
        "say(s) how long a run lives apart from its Airflow task: settings of "
        "TorchDistributorOperator. The hook's run() trains in this process; for a detached run use "
        "hook.start_run(..., durable=..., reattach_timeout=...).",
    ),
    (
        LINEAGE,
        "need(s) the Airflow task's context: settings of TorchDistributorOperator. With the hook, "
        "add the properties to conf yourself: conf=inject_parent_job_information_into_spark_properties("
        "conf, context) (airflow.providers.openlineage.utils.spark).",
    ),
    (
        TRACKING,
        "log(s) the task's run in MLflow from the operator: settings of TorchDistributorOperator. "
        "With the hook, log from your own code (mlflow.start_run() around hook.run()).",
    ),
)


def spec_from_arguments(
    num_processes: int | str, local_mode: bool, use_gpu: bool, settings: dict[str, Any]
) -> TrainingSpec:
    """The validated spec of the hook's arguments; ``settings`` are its other keywords (the
    ``SparkSubmitHook`` ones are popped from it). Refuses the operator's own settings, saying where
    they belong."""
    for scope, why in _OPERATOR_ONLY:
        named = sorted(set(settings) & set(settings_for(scope)))
        if named:
            raise InvalidTrainingConfig(f"{', '.join(named)} {why}")
    given = {"num_processes": num_processes, "local_mode": local_mode, "use_gpu": use_gpu}
    submit_kwargs = {k: settings.pop(k) for k in list(settings) if k not in SETTINGS}
    # A keyword is a SparkSubmitHook argument only if it is one: a typo is the hook's own unknown
    # argument, named with the closest name, not blamed on a spark_submit_kwargs nobody passed.
    taken = submit_hook_arguments() | SUBMIT_KWARGS_EXTRAS
    if unknown := sorted(set(submit_kwargs) - taken):
        raise unknown_arguments(
            "TorchDistributorHook",
            unknown,
            {*HOOK_SETTINGS, *taken, "spec"},
            hint="It takes the settings in docs/reference.md (not those of XCom, a run's lifetime or "
            "OpenLineage) and SparkSubmitHook's arguments.",
            list_known=False,
        )
    submit_kwargs.update(settings.pop("spark_submit_kwargs", None) or {})
    return build_spec(**given, **settings, spark_submit_kwargs=submit_kwargs)
