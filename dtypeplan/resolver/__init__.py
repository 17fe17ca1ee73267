"""Config, rules table and resolved plan: inert data that imports nothing of the optimizers."""

from dtypeplan._dtypes import DTYPE_NAMES, DTYPES
from dtypeplan.resolver._auto import AutoValue, auto_values_from
from dtypeplan.resolver._config import (
    LossScaleConfig,
    OptimizerConfig,
    PrecisionConfig,
)
from dtypeplan.resolver._dimensions import (
    ACCUM,
    COMBINATIONS,
    COMM,
    DIMENSIONS,
    PARAMS,
    PIPELINE,
    REDUCTION,
    SHARDED,
    STAGE,
    Dimension,
    config_for,
)
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._load import load_config
from dtypeplan.resolver._optimizer_kind import register_optimizer
from dtypeplan.resolver._owners import owner_ranks
from dtypeplan.resolver._plan import Alternative, PrecisionPlan, install_builder
from dtypeplan.resolver._resolve import resolve
from dtypeplan.resolver._rules import (
    MAX_RULES,
    Declaration,
    Rule,
    RuleTable,
    Status,
    declaration_boxes,
    load_rules,
)
from dtypeplan.resolver._traffic import Traffic

__all__ = [
    "ACCUM",
    "COMBINATIONS",
    "COMM",
    "DIMENSIONS",
    "DTYPES",
    "DTYPE_NAMES",
    "Alternative",
    "AutoValue",
    "Dimension",
    "FrozenDict",
    "LossScaleConfig",
    "MAX_RULES",
    "OptimizerConfig",
    "PARAMS",
    "PIPELINE",
    "PrecisionConfig",
    "PrecisionPlan",
    "REDUCTION",
    "Rule",
    "RuleTable",
    "SHARDED",
    "STAGE",
    "Status",
    "Traffic",
    "auto_values_from",
    "config_for",
    "install_builder",
    "load_config",
    "Declaration",
    "declaration_boxes",
    "load_rules",
    "register_optimizer",
    "resolve",
    "owner_ranks",
]
