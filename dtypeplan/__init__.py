"""dtypeplan: explicit mixed-precision plans and sharded optimizers for distributed training.

plan = dtypeplan.resolve(config, pipeline_parallel=False)
print(plan.explain())
optimizer = plan.build(model.parameters())
"""

import importlib
from typing import Any

from dtypeplan._api import load_rules, resolve
from dtypeplan.comm import CollectiveError
from dtypeplan.errors import (
    NotSupportedError,
    PrecisionConfigError,
    RankMismatchError,
    RegistryError,
    RulesError,
)
from dtypeplan.optimizers import MixedPrecisionOptimizer, register, registered_names
from dtypeplan.resolver import PrecisionPlan, Status, auto_values_from

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "MixedPrecisionOptimizer",
    "NotSupportedError",
    "PrecisionConfigError",
    "PrecisionPlan",
    "RankMismatchError",
    "RegistryError",
    "RulesError",
    "Status",
    "auto_values_from",
    "checkpoint",
    "load_rules",
    "register",
    "registered_names",
    "resolve",
]


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint costs seconds to import; every spawned rank would pay it.
    if name == "checkpoint":
        return importlib.import_module("dtypeplan.checkpoint")
    raise AttributeError(f"module 'dtypeplan' has no attribute {name!r}")
