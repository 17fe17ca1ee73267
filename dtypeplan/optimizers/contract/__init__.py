"""The ``torch.optim``-like contract every implementation keeps: the base class, ``state_dict``
in ``torch.optim``'s layout, the checked param groups and hyperparameters, what
``prepare_model`` does to the model, and the registry of implementations."""

__all__: list[str] = []
