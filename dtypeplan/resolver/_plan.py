"""The resolved precision plan: inert, hashable data saying exactly what will run.

The plan holds effective values only (``check_nonfinite`` is True under fp16, which always
checks; ``loss_scaling`` is None without fp16), so ``explain()`` and the optimizer read one
derivation. It imports nothing of ``dtypeplan.optimizers``: :meth:`PrecisionPlan.build` and
:meth:`PrecisionPlan.prepare_model` call the builder that ``dtypeplan/__init__.py`` installs
with :func:`install_builder` (``dtypeplan.optimizers.build_optimizer`` / ``prepare_model``, as
torchtitan's ``build_optimizers``). Imports so run one way, optimizers -> resolver, and the
package root, which imports both, is the one place the two layers are joined.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.resolver._config import LossScaleConfig, OptimizerConfig
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._memory import memory_model
from dtypeplan.resolver._rules import Status

__all__ = ["Alternative", "PrecisionPlan", "install_builder"]


class _BuildOptimizer(Protocol):
    def __call__(
        self,
        plan: PrecisionPlan,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.optim.Optimizer: ...


class _PrepareModel(Protocol):
    def __call__(
        self,
        plan: PrecisionPlan,
        model: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module: ...


@dataclass(frozen=True)
class _Builder:
    build_optimizer: _BuildOptimizer
    prepare_model: _PrepareModel


_builder: _Builder | None = None


def install_builder(*, build_optimizer: _BuildOptimizer, prepare_model: _PrepareModel) -> None:
    """Set what :meth:`PrecisionPlan.build` and :meth:`PrecisionPlan.prepare_model` call.

    ``dtypeplan/__init__.py`` installs ``dtypeplan.optimizers``'s builder; importing any part
    of the package runs it first, so a plan can always build.
    """
    global _builder
    _builder = _Builder(build_optimizer=build_optimizer, prepare_model=prepare_model)


def _installed() -> _Builder:
    assert _builder is not None, "dtypeplan/__init__.py installs the optimizer builder"
    return _builder


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
    """Registry name of the optimizer ``build`` makes with a process group (torch.distributed
    initialized); None unless OK."""
    single_process_implementation: str | None
    """Registry name of the optimizer ``build`` makes without torch.distributed (one process,
    no group): the same as ``implementation`` unless the rule names another (ZeRO-3: FSDP2
    needs a group; one process runs the flat sharded optimizer). None unless OK."""
    rule_id: str
    rule_location: str
    """``file:line`` of the deciding rule."""
    reason: str
    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    accumulator_sharded: bool
    comm_dtype: torch.dtype
    """Gradients on the wire; FSDP2's ``MixedPrecisionPolicy.reduce_dtype`` (see
    :attr:`reduce_dtype`)."""
    comm_reduction: str
    """``"collective"`` or ``"fp32_sum"`` (see ``dtypeplan.comm``)."""
    master_dtype: torch.dtype = torch.float32
    zero_stage: int
    pipeline_parallel: bool
    loss_scaling: LossScaleConfig | None
    """fp16 loss scaling; None without fp16, where nothing is scaled."""
    optimizer: OptimizerConfig
    gradient_clipping: float
    reduce_bucket_size: int | None
    check_nonfinite: bool
    """Whether a step with a non-finite gradient norm is skipped: always under fp16."""
    origins: FrozenDict[str, str] = field(default_factory=FrozenDict)
    """Where each effective value came from (a config key or a default's location)."""
    warnings: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    """For a plan that is not OK: the nearest OK configs (fewest changed settings)."""

    @property
    def reduce_dtype(self) -> torch.dtype:
        """FSDP2's name (``MixedPrecisionPolicy.reduce_dtype``) for :attr:`comm_dtype`."""
        return self.comm_dtype

    def implementation_for(self, distributed: bool) -> str | None:
        """The registry name ``build`` makes with (``True``) or without a process group."""
        return self.implementation if distributed else self.single_process_implementation

    # --- reporting ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything about the plan as JSON-serializable data."""
        return {
            "status": str(self.status),
            "implementation": self.implementation,
            "single_process_implementation": self.single_process_implementation,
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
            "loss_scaling": None if self.loss_scaling is None else vars(self.loss_scaling).copy(),
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
        lines = [head]
        if self.single_process_implementation != self.implementation:
            lines.append(
                f"without torch.distributed (one process): "
                f"implementation {self.single_process_implementation!r}"
            )
        lines += [
            f"rule: {self.rule_id} at {self.rule_location}",
            f"reason: {self.reason}",
            "",
            "effective settings:",
        ]
        scaling = "off"
        ls = self.loss_scaling
        if ls is not None:
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
                "on" if self.check_nonfinite else "off",
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

    # --- building (delegated: see the module docstring) ---------------------------------------
    def prepare_model(
        self, model: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """Ready ``model`` for :meth:`build`: ZeRO-3 shards it (FSDP2); other stages keep it.

        Call it before ``build`` and before the model is handed to a pipeline stage.
        """
        return _installed().prepare_model(self, model, process_group)

    def build(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.optim.Optimizer:
        """The optimizer for ``params`` on ``process_group`` (default: the default group).

        Raises :class:`NotSupportedError` or :class:`PrecisionConfigError` for a plan that is
        not OK.
        """
        return _installed().build_optimizer(self, params, process_group)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _kwargs(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()) or "(torch defaults)"
