"""The typed settings of a DeepSpeed-style config: :class:`PrecisionConfig` and its parts.

``_load.load_config`` makes one from a file or a dict, in stages (``_input``, ``_auto``,
``_deepspeed``, ``_schema``, ``_fields``); the values are as given, with no table defaults
applied (those live in ``precision_rules.yaml``; ``_effective.py`` applies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError
from dtypeplan.resolver._auto import AutoValue
from dtypeplan.resolver._dimensions import REDUCTION
from dtypeplan.resolver._frozen import FrozenDict, freeze
from dtypeplan.resolver._optimizer_kind import (
    RegisteredOptimizer,
    needs_whole,
    optimizer_class,
    optimizer_kind,
    registered_optimizer,
    shaped_reason,
    state_bytes_per_param,
    state_kind,
    update_dtype,
)
from dtypeplan.resolver._schema import config_schema

__all__ = [
    "AutoValue",
    "LossScaleConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "config_schema",
]

OptimizerClass = type[torch.optim.Optimizer]
"""A ``torch.optim`` class (an alias: ``OptimizerConfig.type`` shadows the builtin there)."""


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's names and defaults."""

    loss_scale: float = 0.0
    """0 selects dynamic scaling; a positive value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2 ** initial_scale_power``."""
    loss_scale_window: int = 1000
    """Consecutive steps without overflow after which the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated (each one only spends budget) before the scale halves."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow, not only at growth."""
    min_loss_scale: float = 1.0
    """The scale never drops below this value."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which ``torch.optim`` update the master weights get, with torch's argument names."""

    type: str = "AdamW"
    """The optimizer's name as dtypeplan spells it (``_optimizer_kind.canonical_name``): a
    ``torch.optim`` class (``"AdamW"``, ``"RMSprop"``, ``"Adafactor"``...) or one of DeepSpeed's
    own optimizers that ``torch.optim`` lacks (``"Lamb"``, ``"Lion"``...)."""
    params: FrozenDict[str, Any] = field(default_factory=lambda: FrozenDict({"lr": 1e-3}))
    """Keyword arguments of the torch optimizer (``lr``, ``betas``, ``weight_decay``, ...);
    lists given in the config are tuples here, so the config is hashable."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))

    @property
    def torch_class(self) -> OptimizerClass:
        """The ``torch.optim`` class; :class:`NotSupportedError` with the reason for one of
        DeepSpeed's own optimizers, which no ``torch.optim`` class runs."""
        return optimizer_class(self.type)

    def _class_or_none(self) -> OptimizerClass | None:
        try:
            return self.torch_class
        except NotSupportedError:
            return None

    @property
    def kind(self) -> str:
        """The table's ``optimizer`` dimension: ``"elementwise"`` or ``"shaped"``."""
        return optimizer_kind(self._class_or_none())

    @property
    def state_kind(self) -> str:
        """The table's ``state_kind`` dimension: ``"moments"``, ``"step_sizes"`` (Rprop) or
        ``"averaged_weights"`` (ASGD)."""
        return state_kind(self._class_or_none())

    @property
    def param_access(self) -> str:
        """The table's ``param_access`` dimension: ``"owner"`` for a class that needs each
        parameter whole (``_optimizer_kind.needs_whole``), else ``"flat"``."""
        return "owner" if needs_whole(self._class_or_none()) else "flat"

    @property
    def update_dtype(self) -> torch.dtype:
        """The dtype the class computes its update in (``_optimizer_kind.update_dtype``): bf16
        for Muon's Newton-Schulz, else fp32."""
        return update_dtype(self._class_or_none())

    @property
    def registered(self) -> RegisteredOptimizer | None:
        """What ``dtypeplan.register_optimizer`` was told about the class (its declared
        per-element states), None for a ``torch.optim`` class."""
        return registered_optimizer(self._class_or_none())

    @property
    def kind_reason(self) -> str:
        """Why the optimizer is of its kind (for a shaped one: why flat shards cannot run it)."""
        return shaped_reason(self.type, self._class_or_none())

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 optimizer-state bytes per parameter (Adam: m and v; SGD: momentum if any);
        :class:`NotSupportedError` for a shaped optimizer, which dtypeplan does not run."""
        if self.param_access == "owner":
            raise NotSupportedError(
                f"the optimizer {self.type} runs on whole parameters ({self.kind_reason}): "
                "its states depend on each parameter's shape, so they have no bytes per "
                "parameter; plan.memory(param_shapes=...) counts them parameter by parameter "
                "(_optimizer_kind.whole_states)"
            )
        if self.kind != "elementwise":
            raise NotSupportedError(
                f"the optimizer {self.type} is shaped ({self.kind_reason}): dtypeplan does not "
                "run it, so no state bytes are counted for it"
            )
        return state_bytes_per_param(self.torch_class, self.params)


FP8_EXCLUDED_BY_DEFAULT = ("lm_head", "output", "score", "classifier")
"""Linear layers fp8 compute leaves in the parameter dtype unless ``fp8.exclude_modules`` says
otherwise: the output layers of GPT-2 / Llama (HF), torchtitan, and HF's sequence
classification heads; fp8's 3-bit mantissa costs most on the logits."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The precision-relevant settings of a config, as given (``None`` = not set)."""

    bf16: bool = False
    fp16: bool = False
    loss_scaling: LossScaleConfig = field(default_factory=LossScaleConfig)
    grad_accum_dtype: str | None = None
    """``"fp32"``, ``"fp16"`` or ``"bf16"``; ``None`` lets the rules table choose."""
    grad_accum_dtype_key: str | None = None
    """Where ``grad_accum_dtype`` was given (a JSON path), for ``explain()``."""
    accumulator_sharded: bool | None = None
    comm_dtype: str | None = None
    comm_reduction: str = REDUCTION.default_value
    zero_stage: int | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_given: bool = False
    gradient_clipping: float = 0.0
    gradient_clipping_given: bool = False
    """Whether the config has the key (DeepSpeed clips at 1.0 without it; dtypeplan does not)."""
    reduce_bucket_size: int | None = None
    check_nonfinite: bool = False
    collective_timeout_s: float = 600.0
    """How long a collective waits for a stalled or dead peer before it fails."""
    ignored_keys: tuple[str, ...] = ()
    """JSON paths of DeepSpeed keys that were accepted and change neither numbers nor memory."""
    source: str | None = None
    """The file the config came from, if any."""
    master_weights_dtype: str = "fp32"
    """The master dimension's value: ``"fp32"``; ``"bf16"`` (round to nearest:
    ``bf16.bf16_master_weights_and_grads`` or ``master_weights: {dtype: bf16}``), ``"bf16_sr"``
    (``rounding: stochastic``), ``"bf16_kahan"`` (``rounding: kahan``); ``"fp16"``
    (``fp16.fp16_master_weights_and_grads``)."""
    optimizer_states_dtype: str = "fp32"
    """The states dimension's value (``_dimensions.STATE_PAIRS``): one dtype for both moments
    (``"fp32"``, ``"bf16"``, ``"int8"``, ``"fp8"``) or ``"exp_avg/exp_avg_sq"`` (``"bf16/fp32"``),
    from ``optimizer_states``, ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` or
    ``bf16.bf16_optimizer_states`` (or ``fp32_optimizer_states: false`` under optimizer
    offload, where DeepSpeed's CPU Adam keeps the moments in the parameter dtype)."""
    autocast: str = "none"
    """``"bf16"`` / ``"fp16"``: ``torch_autocast`` enabled with that dtype; ``"none"``."""
    autocast_dtype_given: bool = False
    """Whether ``torch_autocast.dtype`` was given (without it dtypeplan picks one; DeepSpeed
    passes None on to ``torch.autocast``: see ``_differences.py``)."""
    offload_optimizer: str = "none"
    """``"cpu"`` / ``"nvme"``: ``zero_optimization.offload_optimizer.device`` (or
    ``cpu_offload``); ``"none"``."""
    offload_param: str = "none"
    """``"cpu"`` / ``"nvme"``: ``zero_optimization.offload_param.device``; ``"none"``."""
    quantized_communication: str = "none"
    """``"weights"``, ``"gradients"`` or ``"both"`` (ZeRO++ ``zero_quantized_*``); ``"none"``."""
    hierarchical_partitioning: bool = False
    """ZeRO++ ``zero_hpz_partition_size`` above 1."""
    hpz_partition_size: int = 1
    """ZeRO++ ``zero_hpz_partition_size``: the ranks of hpZ's secondary partition (1: off)."""
    zero_settings: tuple[tuple[str, Any], ...] = ()
    """``(canonical name, value)`` of each ``_fields.ZERO_SETTINGS`` key the config gives
    (ZeRO-3 prefetch / persistence / live-parameter limits, ``sub_group_size``,
    ``overlap_comm``, the offloads' ``pin_memory``): DeepSpeed changes memory or overlap with
    them, dtypeplan does otherwise, and ``explain()`` says how."""
    shard_group_size: int | None = None
    """``zero_optimization.shard_group_size`` (``"auto"`` filled from ``LOCAL_WORLD_SIZE``);
    None: the flat layout."""
    wire_across_groups: str | None = None
    """``communication_data_type_across_groups`` (or ``"int8"`` from ZeRO++'s
    ``zero_quantized_gradients`` with shard groups); None: the communication dtype."""
    wire_across_groups_key: str | None = None
    """Where :attr:`wire_across_groups` came from (a JSON path), for ``explain()``."""
    gradient_prescaling: str = "none"
    """``"prescale"`` (``prescale_gradients``), ``"predivide"`` (``gradient_predivide_factor``
    other than 1) or ``"none"``."""
    fp8: bool = False
    """The ``fp8`` block enabled."""
    fp8_recipe: str = "tensorwise"
    """``fp8.recipe``: ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, ``"mxfp8"``."""
    fp8_all_gather: str = "param_dtype"
    """``fp8.all_gather``: ``"param_dtype"`` or ``"fp8"`` (ZeRO-3, tensorwise)."""
    fp8_exclude_modules: tuple[str, ...] = FP8_EXCLUDED_BY_DEFAULT
    """``fp8.exclude_modules``: names or fnmatch patterns of linear layers left unconverted."""
    fp8_emulate: str = "auto"
    """``fp8.emulate``: ``"auto"``, ``"true"`` or ``"false"``."""
    scheduler: FrozenDict[str, Any] | None = None
    """DeepSpeed's ``scheduler`` block (``{"type", "params"}``), validated; None without one."""
    gradient_accumulation_steps: int | None = None
    """DeepSpeed's ``gradient_accumulation_steps`` (the caller runs the micro-batches)."""
    train_batch_size: int | None = None
    """DeepSpeed's ``train_batch_size``: samples per step over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: int | None = None
    """DeepSpeed's ``train_micro_batch_size_per_gpu``: samples per micro-batch on one rank."""
    auto_values: tuple[AutoValue, ...] = ()
    """Every ``"auto"`` of the config, the value used and where it came from."""
    config_warnings: tuple[str, ...] = ()
    """Unknown top-level keys (with the closest known key), model-side DeepSpeed settings that
    dtypeplan does not run, and other readings of the config worth a look."""


# (PrecisionConfig field, its "not used" default, the DeepSpeed key that sets it): the
# settings that change numbers or memory beyond the original dimensions of the table.
DEEPSPEED_PRECISION_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("master_weights_dtype", "fp32", "bf16.bf16_master_weights_and_grads"),
    ("optimizer_states_dtype", "fp32", "bf16.bf16_optimizer_states"),
    ("autocast", "none", "torch_autocast"),
    ("offload_optimizer", "none", "zero_optimization.offload_optimizer"),
    ("offload_param", "none", "zero_optimization.offload_param"),
    ("quantized_communication", "none", "zero_optimization.zero_quantized_*"),
    ("hierarchical_partitioning", False, "zero_optimization.zero_hpz_partition_size"),
    ("gradient_prescaling", "none", "prescale_gradients / gradient_predivide_factor"),
    ("fp8", False, "fp8"),
)
