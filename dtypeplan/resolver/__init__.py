"""Config, rules table and resolved plan: inert data that imports nothing of the optimizers."""

from dtypeplan._dtypes import DTYPE_NAMES, DTYPES
from dtypeplan.resolver._config import (
    LossScaleConfig,
    OptimizerConfig,
    PrecisionConfig,
    load_config,
)
from dtypeplan.resolver._dimensions import COMBINATIONS, DIMENSIONS, Dimension
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._plan import Alternative, PrecisionPlan, install_builder
from dtypeplan.resolver._resolve import resolve
from dtypeplan.resolver._rules import MAX_RULES, Rule, RuleTable, Status, load_rules

__all__ = [
    "COMBINATIONS",
    "DIMENSIONS",
    "DTYPES",
    "DTYPE_NAMES",
    "Alternative",
    "Dimension",
    "FrozenDict",
    "LossScaleConfig",
    "MAX_RULES",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrecisionPlan",
    "Rule",
    "RuleTable",
    "Status",
    "install_builder",
    "load_config",
    "load_rules",
    "resolve",
]
