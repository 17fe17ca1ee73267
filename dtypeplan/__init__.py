"""dtypeplan: explicit mixed-precision plans and sharded optimizers for distributed training.

plan = dtypeplan.resolve(config, pipeline_parallel=False)
print(plan.explain())
optimizer = plan.build(model.parameters())
"""

# Every name is imported on first use (PEP 562): ``import dtypeplan`` costs nothing, so the
# command line answers ``--help`` without importing torch, and a spawned rank that needs only
# the launcher does not import torch.distributed.checkpoint.
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtypeplan import checkpoint
    from dtypeplan._api import load_rules, resolve
    from dtypeplan.comm import CollectiveError
    from dtypeplan.errors import (
        NotSupportedError,
        PrecisionConfigError,
        RankMismatchError,
        RegistryError,
        RulesError,
    )
    from dtypeplan.lion import Lion
    from dtypeplan.optimizers import MixedPrecisionOptimizer, register, registered_names
    from dtypeplan.planner import plan_for
    from dtypeplan.resolver import PrecisionPlan, Status, auto_values_from, register_optimizer

__version__ = "0.1.0"

_HOMES = {
    "CollectiveError": "dtypeplan.comm",
    "Lion": "dtypeplan.lion",
    "MixedPrecisionOptimizer": "dtypeplan.optimizers",
    "NotSupportedError": "dtypeplan.errors",
    "PrecisionConfigError": "dtypeplan.errors",
    "PrecisionPlan": "dtypeplan.resolver",
    "RankMismatchError": "dtypeplan.errors",
    "RegistryError": "dtypeplan.errors",
    "RulesError": "dtypeplan.errors",
    "Status": "dtypeplan.resolver",
    "auto_values_from": "dtypeplan.resolver",
    "load_rules": "dtypeplan._api",
    "plan_for": "dtypeplan.planner",
    "register": "dtypeplan.optimizers",
    "register_optimizer": "dtypeplan.resolver",
    "registered_names": "dtypeplan.optimizers",
    "resolve": "dtypeplan._api",
}

__all__ = [
    "CollectiveError",
    "Lion",
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
    "plan_for",
    "register",
    "register_optimizer",
    "registered_names",
    "resolve",
]
assert set(__all__) == {*_HOMES, "checkpoint"}, "every public name has a home module"


def __getattr__(name: str) -> Any:
    if name == "checkpoint":
        return importlib.import_module("dtypeplan.checkpoint")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dtypeplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
