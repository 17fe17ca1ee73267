"""Optimizer implementations and the registry the rules table names them in."""

from dtypeplan.optimizers._build import build_optimizer, implementation_class, prepare_model
from dtypeplan.optimizers.contract import (
    MixedPrecisionOptimizer,
    builtin_declarations,
    get_implementation,
    register,
    registered_declarations,
    registered_names,
)
from dtypeplan.optimizers.flat import ReplicatedOptimizer, ShardedOptimizer
from dtypeplan.optimizers.fsdp2 import FSDP2Optimizer
from dtypeplan.optimizers.grads import LossScaler, MinimumLossScaleError
from dtypeplan.optimizers.state import HeldTensors
from dtypeplan.optimizers.whole import WholeTensorOptimizer

__all__ = [
    "FSDP2Optimizer",
    "HeldTensors",
    "LossScaler",
    "MinimumLossScaleError",
    "MixedPrecisionOptimizer",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "WholeTensorOptimizer",
    "build_optimizer",
    "builtin_declarations",
    "get_implementation",
    "implementation_class",
    "prepare_model",
    "register",
    "registered_declarations",
    "registered_names",
]
