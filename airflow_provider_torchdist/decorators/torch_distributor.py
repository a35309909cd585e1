"""``@task.torch_distributor``: a TaskFlow training function that runs on every rank.

Example::

    from airflow.sdk import dag, task


    @task.torch_distributor(num_processes=2, local_mode=True)
    def train(data_path: str, lr: float = 0.1) -> dict:  # runs on every rank
        ...
        return {"loss": loss.item()}  # rank 0's is the task's value


    @dag(schedule=None)
    def pipeline():
        train(prepare())  # an upstream task's value as an argument
        train.partial(data_path="/data").expand(lr=[0.1, 0.01])  # a sweep

The operator is Airflow's ``DecoratedOperator`` composed with
:class:`~airflow_provider_torchdist.operators.torch_distributor.TorchDistributorOperator`: the
call's arguments are rendered (upstream values resolved) as ``op_args`` and ``op_kwargs``, become
the run's ``args`` and ``kwargs``, and the decorated function is cloudpickled to the ranks as its
``train_object``; ``execute`` is the operator's. The decorator takes every operator argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.providers.common.compat.sdk import DecoratedOperator, TaskDecorator, task_decorator_factory

from airflow_provider_torchdist.errors import InvalidTrainingConfig
from airflow_provider_torchdist.operators.torch_distributor import TorchDistributorOperator

#: Operator arguments that the decorator fills itself: the function and its call's arguments.
FROM_THE_CALL = ("train_object", "args", "kwargs")


def _context_keys() -> frozenset[str]:
    """The names Airflow fills from the task context in a plain ``@task`` (``ti``, ``ds``, ...)."""
    try:
        from airflow.sdk.definitions.context import KNOWN_CONTEXT_KEYS
    except ImportError:  # Airflow 3.0 keeps them here
        from airflow.utils.context import KNOWN_CONTEXT_KEYS

    return frozenset(KNOWN_CONTEXT_KEYS)


def check_no_context_parameters(
    function: Callable[..., Any], op_args: Collection[Any], op_kwargs: Mapping[str, Any]
) -> None:
    """Refuse a parameter named like a task-context key (``ti``, ``ds``, ...) that the call leaves
    unfilled: the function runs on the ranks, where there is no task context, and a plain ``@task``
    would have filled it, so it would silently get None."""
    signature = inspect.signature(function)
    given = signature.bind_partial(*op_args, **op_kwargs).arguments
    missing = [
        name
        for name, param in signature.parameters.items()
        if name in _context_keys() and name not in given and param.default is inspect.Parameter.empty
    ]
    if missing:
        raise InvalidTrainingConfig(
            f"@task.torch_distributor function {function.__name__}() has the parameter(s) "
            f"{', '.join(missing)}, named like task-context keys, which this decorator does not fill: "
            "the function runs on every rank, where there is no task context. Pass the values the "
            "training needs as arguments (e.g. train(run_id='{{ run_id }}')), or rename the parameter."
        )


class TorchDistributorDecoratedOperator(DecoratedOperator, TorchDistributorOperator):
    """The operator ``@task.torch_distributor`` makes: the decorated function is ``train_object``,
    the call's (rendered) arguments are ``args`` and ``kwargs``, and rank 0's return value is the
    task's XCom value, in the operator's envelope.

    :param python_callable: the training function, run on every rank.
    :param op_args: the call's positional arguments (templated; upstream values allowed).
    :param op_kwargs: the call's keyword arguments (templated; upstream values allowed).
    """

    custom_operator_name: str = "@task.torch_distributor"
    template_fields: Sequence[str] = (
        *DecoratedOperator.template_fields,
        *TorchDistributorOperator.template_fields,
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **TorchDistributorOperator.template_fields_renderers,
    }

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        given = [name for name in FROM_THE_CALL if name in kwargs]
        if given:
            raise InvalidTrainingConfig(
                f"@task.torch_distributor does not take {', '.join(given)}: the decorated function is "
                "the training function, and the arguments you call it with are its arguments, e.g. "
                f"{python_callable.__name__}(1e-3, epochs=3). For a script, use TorchDistributorOperator."
            )
        if kwargs.get("multiple_outputs"):
            raise InvalidTrainingConfig(_MULTIPLE_OUTPUTS)
        kwargs["multiple_outputs"] = False
        if not kwargs.get("_airflow_mapped_validation_only"):  # expanded arguments come later
            check_no_context_parameters(python_callable, op_args or [], op_kwargs or {})
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            kwargs_to_upstream={"train_object": python_callable},
            **kwargs,
        )

    def execute(self, context: Any) -> Any:
        # The rendered call arguments are the run's: they are also what ``map_index_template``
        # reads as ``task.train_kwargs``, as for the operator.
        self.train_args = list(self.op_args)
        self.train_kwargs = dict(self.op_kwargs)
        # The operator's own execute, not DecoratedOperator's: that one only adds asset inlets and
        # handles multiple_outputs (always off here), and on Airflow 3.0 it calls a missing xcom_push.
        from airflow.sdk.definitions.asset import Asset

        self.inlets.extend(a for a in (*self.op_args, *self.op_kwargs.values()) if isinstance(a, Asset))
        return TorchDistributorOperator.execute(self, context)


_MULTIPLE_OUTPUTS = (
    "@task.torch_distributor does not take multiple_outputs=True: the task's value is rank 0's "
    "return value in one signed envelope (read it with load_output). Return a dict and pick its keys "
    "downstream."
)


def torch_distributor_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """``@task.torch_distributor(num_processes=..., ...)``: train the decorated function on every
    rank, as :class:`~airflow_provider_torchdist.operators.torch_distributor.TorchDistributorOperator`
    would with ``train_object=`` the function (see the module docstring for an example).

    ``kwargs`` are the operator's arguments (every one but ``train_object``, ``args`` and
    ``kwargs``, which come from the function and its call). ``multiple_outputs`` must stay off:
    even a function annotated ``-> dict`` pushes one value.
    """
    if multiple_outputs:
        raise InvalidTrainingConfig(_MULTIPLE_OUTPUTS)
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=False,
        decorated_operator_class=TorchDistributorDecoratedOperator,
        **kwargs,
    )
