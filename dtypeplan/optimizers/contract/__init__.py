"""The ``torch.optim``-like contract every implementation keeps: the base class, ``state_dict``
in ``torch.optim``'s layout, the checked param groups and hyperparameters, what
``prepare_model`` does to the model, and the registry of implementations."""

from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer, WrapPolicy
from dtypeplan.optimizers.contract.registry import get_implementation, register, registered_names

__all__ = [
    "MixedPrecisionOptimizer",
    "WrapPolicy",
    "get_implementation",
    "register",
    "registered_names",
]
