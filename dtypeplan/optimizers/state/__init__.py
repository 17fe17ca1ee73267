"""What the optimizer state holds, how it is named, stored and counted, apart from any layout:
the ``param.{i}.{name}`` / ``scalar.{name}`` keys, per-element and scalar values, one moment
stored in its format (``dtypeplan/_formats.py``: fp32, bf16, int8 or fp8 blocks), bf16 masters
and low-precision moments, and the tensors a rank holds by ``plan.memory()`` component."""

from dtypeplan.optimizers.state.held import HeldTensors
from dtypeplan.optimizers.state.keys import (
    KAHAN_COMPENSATION,
    LOSS_SCALE,
    MASTER,
    MOMENTS,
    NO_STATE,
    SKIPPED_STEPS,
    STEP,
    param_index,
    param_key,
    param_state_names,
    parse_group_scalar_key,
    parse_param_key,
    parse_param_scalar_key,
    scalar_key,
    scaler_key,
    scaler_state,
)
from dtypeplan.optimizers.state.low_precision import SavedCodes
from dtypeplan.optimizers.state.values import ShardPiece

__all__ = [
    "KAHAN_COMPENSATION",
    "LOSS_SCALE",
    "MASTER",
    "MOMENTS",
    "NO_STATE",
    "SKIPPED_STEPS",
    "STEP",
    "HeldTensors",
    "SavedCodes",
    "ShardPiece",
    "param_index",
    "param_key",
    "param_state_names",
    "parse_group_scalar_key",
    "parse_param_key",
    "parse_param_scalar_key",
    "scalar_key",
    "scaler_key",
    "scaler_state",
]
