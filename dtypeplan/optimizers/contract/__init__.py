"""The ``torch.optim``-like contract every implementation keeps: the base class, ``state_dict``
in ``torch.optim``'s layout, the checked param groups and hyperparameters, what
``prepare_model`` does to the model (fp8 compute's conversion of its linear layers included),
and the registry of implementations."""

from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer, WrapPolicy
from dtypeplan.optimizers.contract.fp8_compute import (
    MXFP8Linear,
    convert_linears,
    fp8_all_gather_weights,
    fp8_weight_numels,
    precompute_scales,
)
from dtypeplan.optimizers.contract.registry import (
    builtin_declarations,
    get_implementation,
    register,
    registered_declarations,
    registered_names,
)

__all__ = [
    "MXFP8Linear",
    "MixedPrecisionOptimizer",
    "convert_linears",
    "fp8_all_gather_weights",
    "fp8_weight_numels",
    "precompute_scales",
    "WrapPolicy",
    "builtin_declarations",
    "get_implementation",
    "register",
    "registered_declarations",
    "registered_names",
]
