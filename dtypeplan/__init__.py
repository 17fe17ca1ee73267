"""dtypeplan: explicit mixed-precision plans and sharded optimizers for distributed training.

    plan = dtypeplan.resolve(config, pipeline_parallel=False)
    print(plan.explain())
    optimizer = plan.build(model.parameters())
"""

from dtypeplan import checkpoint
from dtypeplan.errors import NotSupportedError, PrecisionConfigError, RankMismatchError, RulesError
from dtypeplan.optimizers import MixedPrecisionOptimizer, register, registered_names
from dtypeplan.resolver import PrecisionPlan, Status, load_rules, resolve

__version__ = "0.1.0"

__all__ = [
    "MixedPrecisionOptimizer",
    "NotSupportedError",
    "PrecisionConfigError",
    "PrecisionPlan",
    "RankMismatchError",
    "RulesError",
    "Status",
    "checkpoint",
    "load_rules",
    "register",
    "registered_names",
    "resolve",
]
