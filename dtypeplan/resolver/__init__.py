"""Config validation, the rules table and the resolved plan."""

from dtypeplan.resolver._config import (
    LossScaleConfig,
    OptimizerConfig,
    PrecisionConfig,
    load_config,
)
from dtypeplan.resolver._plan import DTYPES, PrecisionPlan, Status
from dtypeplan.resolver._resolve import resolve
from dtypeplan.resolver._rules import DIMENSIONS, Rule, RuleTable, load_rules

__all__ = [
    "DIMENSIONS",
    "DTYPES",
    "LossScaleConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrecisionPlan",
    "Rule",
    "RuleTable",
    "Status",
    "load_config",
    "load_rules",
    "resolve",
]
