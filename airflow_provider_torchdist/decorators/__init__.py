"""The TaskFlow decorator: ``@task.torch_distributor``, the operator for a decorated function.

``torch_distributor`` holds the decorator (registered in ``get_provider_info``'s
``task-decorators``) and the operator it makes, which is
:class:`~airflow_provider_torchdist.operators.torch_distributor.TorchDistributorOperator` with the
decorated function as its ``train_object``.

It may import ``operators`` and every layer below it; never ``ui``.
"""
