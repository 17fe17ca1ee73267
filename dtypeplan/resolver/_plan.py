"""The resolved precision plan: every effective dtype, the deciding rule, and ``build``."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.resolver._config import LossScaleConfig, OptimizerConfig
from dtypeplan.resolver._memory import memory_model

if TYPE_CHECKING:
    from dtypeplan.optimizers._base import MixedPrecisionOptimizer

__all__ = ["DTYPES", "DTYPE_NAMES", "PrecisionPlan", "Status"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class Status(str, enum.Enum):
    """What the table says of a combination. Compares equal to its string."""

    OK = "OK"
    NOT_SUPPORTED = "NotSupported"
    ERROR = "Error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A nearby combination the table calls OK, and the config changes that reach it."""

    changes: tuple[str, ...]
    rule_id: str
    implementation: str


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    """What dtypeplan will do for one config. Built by :func:`dtypeplan.resolve`."""

    status: Status
    implementation: str | None
    """Registry name of the optimizer ``build`` makes; None unless OK."""
    rule_id: str
    rule_location: str
    """``file:line`` of the deciding rule."""
    reason: str
    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    accumulator_sharded: bool
    comm_dtype: torch.dtype
    comm_reduction: str
    """``"collective"`` or ``"fp32_sum"`` (see ``dtypeplan.comm``)."""
    master_dtype: torch.dtype = torch.float32
    zero_stage: int
    pipeline_parallel: bool
    loss_scaling: LossScaleConfig
    optimizer: OptimizerConfig
    gradient_clipping: float
    reduce_bucket_size: int | None
    check_nonfinite: bool
    origins: Mapping[str, str] = field(default_factory=dict)
    """Where each effective value came from (a config key or a default's location)."""
    warnings: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    """For a plan that is not OK: the nearest OK configs (fewest changed settings)."""

    # --- reporting ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything about the plan as JSON-serializable data."""
        return {
            "status": str(self.status),
            "implementation": self.implementation,
            "rule_id": self.rule_id,
            "rule_location": self.rule_location,
            "reason": self.reason,
            "param_dtype": DTYPE_NAMES[self.param_dtype],
            "grad_accum_dtype": DTYPE_NAMES[self.grad_accum_dtype],
            "accumulator_sharded": self.accumulator_sharded,
            "comm_dtype": DTYPE_NAMES[self.comm_dtype],
            "comm_reduction": self.comm_reduction,
            "master_dtype": DTYPE_NAMES[self.master_dtype],
            "zero_stage": self.zero_stage,
            "pipeline_parallel": self.pipeline_parallel,
            "loss_scaling": vars(self.loss_scaling).copy()
            if self.param_dtype == torch.float16
            else None,
            "optimizer": {"type": self.optimizer.type, "params": _jsonable(self.optimizer.params)},
            "gradient_clipping": self.gradient_clipping,
            "reduce_bucket_size": self.reduce_bucket_size,
            "check_nonfinite": self.check_nonfinite,
            "origins": dict(self.origins),
            "warnings": list(self.warnings),
            "ignored_keys": list(self.ignored_keys),
            "alternatives": [
                {
                    "changes": list(a.changes),
                    "rule_id": a.rule_id,
                    "implementation": a.implementation,
                }
                for a in self.alternatives
            ],
        }

    def rank_facts(self) -> dict[str, Any]:
        """What must agree across the ranks of one group (not where each value came from)."""
        data = self.to_dict()
        for key in ("origins", "warnings", "ignored_keys", "alternatives", "rule_location"):
            data.pop(key)
        return data

    def digest(self) -> str:
        """A hash of :meth:`rank_facts`."""
        return hashlib.sha256(json.dumps(self.rank_facts(), sort_keys=True).encode()).hexdigest()

    def memory(self, num_params: int, world_size: int) -> dict[str, int]:
        """Predicted bytes per rank at the accumulation boundary (see ``resolver/_memory.py``)."""
        return memory_model(
            num_params=num_params,
            world_size=world_size,
            param_dtype=self.param_dtype,
            accum_dtype=self.grad_accum_dtype,
            accumulator_sharded=self.accumulator_sharded and world_size > 1,
            zero_stage=self.zero_stage,
            state_bytes_per_param=self.optimizer.state_bytes_per_param,
        )

    def explain(self) -> str:
        """A human-readable account of the decision and of every effective setting."""
        head = f"status: {self.status}"
        if self.implementation:
            head += f" (implementation {self.implementation!r})"
        lines = [
            head,
            f"rule: {self.rule_id} at {self.rule_location}",
            f"reason: {self.reason}",
            "",
            "effective settings:",
        ]
        scaling = "off"
        if self.param_dtype == torch.float16:
            ls = self.loss_scaling
            scaling = (
                f"static {ls.loss_scale:g}"
                if ls.loss_scale > 0
                else f"dynamic from 2**{ls.initial_scale_power}, window {ls.loss_scale_window}, "
                f"hysteresis {ls.hysteresis}, min {ls.min_loss_scale:g}"
            )
        rows = [
            ("parameters", DTYPE_NAMES[self.param_dtype], "param_dtype"),
            ("gradient accumulation", DTYPE_NAMES[self.grad_accum_dtype], "grad_accum_dtype"),
            (
                "accumulator",
                "sharded" if self.accumulator_sharded else "whole",
                "accumulator_sharded",
            ),
            ("communication", DTYPE_NAMES[self.comm_dtype], "comm_dtype"),
            ("reduction", self.comm_reduction, "comm_reduction"),
            ("master weights", DTYPE_NAMES[self.master_dtype], "master_dtype"),
            ("ZeRO stage", str(self.zero_stage), "zero_stage"),
            ("pipeline parallel", "yes" if self.pipeline_parallel else "no", "pipeline_parallel"),
            ("loss scaling", scaling, "loss_scaling"),
            ("optimizer", f"{self.optimizer.type} {_kwargs(self.optimizer.params)}", "optimizer"),
            (
                "gradient clipping",
                f"global L2 norm {self.gradient_clipping:g}" if self.gradient_clipping else "off",
                "gradient_clipping",
            ),
            (
                "non-finite check",
                "on" if self.check_nonfinite or self.param_dtype == torch.float16 else "off",
                "check_nonfinite",
            ),
        ]
        width = max(len(r[0]) for r in rows)
        value_width = min(max(len(r[1]) for r in rows), 12)
        for label, value, key in rows:
            lines.append(
                f"  {label:<{width}}  {value:<{value_width}}  <- {self.origins.get(key, 'fixed')}"
            )
        if self.warnings:
            lines += ["", "warnings:"] + [f"  - {w}" for w in self.warnings]
        if self.ignored_keys:
            lines += ["", "ignored (DeepSpeed keys that do not bear on precision):"]
            lines += [f"  {', '.join(self.ignored_keys)}"]
        if self.status != Status.OK:
            lines += ["", "nearest supported configs:"]
            if not self.alternatives:
                lines.append("  none: no rule of this table is OK")
            for alt in self.alternatives:
                changes = "; ".join(alt.changes)
                lines.append(f"  - {changes}  -> OK ({alt.implementation}, rule {alt.rule_id})")
        return "\n".join(lines)

    # --- building -----------------------------------------------------------------------------
    def prepare_model(
        self, model: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """Ready ``model`` for :meth:`build`: ZeRO-3 shards it (FSDP2); other stages keep it.

        Call it before ``build`` and before the model is handed to a pipeline stage.
        """
        if self.status != Status.OK:
            return model
        from dtypeplan.optimizers import get_implementation

        return get_implementation(self.implementation).prepare_model(
            model, plan=self, process_group=process_group
        )

    def build(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
    ) -> MixedPrecisionOptimizer:
        """The optimizer for ``params`` on ``process_group`` (default: the default group)."""
        if self.status == Status.ERROR:
            raise PrecisionConfigError(
                f"{self.reason} (rule {self.rule_id} at {self.rule_location})"
            )
        if self.status == Status.NOT_SUPPORTED:
            raise NotSupportedError(f"{self.reason} (rule {self.rule_id} at {self.rule_location})")
        from dtypeplan.optimizers import get_implementation

        cls = get_implementation(self.implementation)
        return cls(params, plan=self, process_group=process_group)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _kwargs(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()) or "(torch defaults)"
