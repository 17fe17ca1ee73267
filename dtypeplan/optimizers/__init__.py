"""Optimizer implementations and the registry the rules table names them in."""

from dtypeplan.optimizers._build import build_optimizer, implementation_class, prepare_model
from dtypeplan.optimizers.contract.base import HeldTensors, MixedPrecisionOptimizer
from dtypeplan.optimizers.contract.registry import get_implementation, register, registered_names
from dtypeplan.optimizers.flat import ReplicatedOptimizer, ShardedOptimizer
from dtypeplan.optimizers.fsdp2.optimizer import FSDP2Optimizer
from dtypeplan.optimizers.grads.loss_scaler import LossScaler, MinimumLossScaleError

__all__ = [
    "FSDP2Optimizer",
    "HeldTensors",
    "LossScaler",
    "MinimumLossScaleError",
    "MixedPrecisionOptimizer",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "build_optimizer",
    "get_implementation",
    "implementation_class",
    "prepare_model",
    "register",
    "registered_names",
]
