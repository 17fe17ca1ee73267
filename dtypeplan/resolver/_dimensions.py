"""The dimensions of the configuration space: one record each, read by everything else.

A *point* of the space has one value on every dimension. Each :class:`Dimension` says, once,
what the rules loader checks (``name``, ``values``), where a config sets it (``config_key``,
:meth:`Dimension.config_for`) and how a feature's value is read from a loaded config
(``read``), what applies when the config is silent (``default``) and where a value came from
(:meth:`Dimension.origin`), what the plan derives from the value (``attributes``: the plan's
attributes and ``to_dict`` keys), how the resolver advises a change (:meth:`Dimension.setting`),
how the table shows it (``title``, :meth:`Dimension.show`) and how ``explain()`` writes it
(``label``, :meth:`Dimension.describe`). The rules loader, the resolver, the plan, the report,
the table renderer, the schemas' enums and the docs' figures (``dtypeplan/docs_pages.py``) all
read these records (in the spirit of torchgen's ``model.py``). Adding a feature dimension means
one record here (in ``FEATURE_DIMENSIONS`` at its display place), the code that reads its value
from a config (a ``PrecisionConfig`` field and ``_fields.py``), the rules that name it, and
``python -m dtypeplan docs --write`` for the generated schema enums and pages
(``tests/test_dimension_records.py`` adds one and checks the rest follows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtypeplan._dtypes import DTYPES
from dtypeplan._formats import FORMATS
from dtypeplan.resolver._fp8_device import fp8_execution
from dtypeplan.resolver._frozen import FrozenDict, freeze

if TYPE_CHECKING:
    from dtypeplan.resolver._config import PrecisionConfig

__all__ = [
    "ACCUM",
    "AUTOCAST",
    "COMBINATIONS",
    "COMM",
    "CORE_COMBINATIONS",
    "CORE_DIMENSIONS",
    "DIMENSIONS",
    "Dimension",
    "FEATURES_UNUSED",
    "FEATURE_DIMENSIONS",
    "FP8",
    "FP8_ALL_GATHER",
    "FP8_EXECUTION",
    "FP8_RECIPE",
    "FP8_RECIPES",
    "GRADIENT_PRESCALING",
    "HIERARCHICAL_PARTITIONING",
    "MASTER",
    "MASTER_ROUNDING",
    "OFFLOAD_OPTIMIZER",
    "OFFLOAD_PARAM",
    "OPTIMIZER_KIND",
    "PARAMS",
    "PARAM_ACCESS",
    "PIPELINE",
    "Point",
    "QUANTIZED_COMMUNICATION",
    "REDUCTION",
    "SHARDED",
    "SHARD_GROUPS",
    "STAGE",
    "STATES",
    "STATE_DTYPES",
    "STATE_KIND",
    "STATE_PAIRS",
    "WIRES_ACROSS",
    "config_for",
    "points",
    "shard_groups_value",
    "states_value",
    "value_text",
]

Point = Mapping[str, Any]
"""One value per dimension, keyed by :attr:`Dimension.name`."""


def value_text(value: Any) -> str:
    """A dimension value as the rules file spells it (``true``, ``3``, ``bf16``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One dimension of the table."""

    name: str
    """Its key in a rule's ``when`` and in a point."""
    values: tuple[Any, ...]
    """Every value, in display order."""
    doc: str
    """What the dimension means."""
    config_key: str
    """Where a user sets it: a config key (dotted) or a ``resolve`` argument."""
    default: str
    """What applies when the config is silent, in words."""
    default_value: Any = None
    """That value, where it is fixed here; ``None`` where the rules file's defaults decide."""
    title: str
    """Its column heading in the rendered table."""
    choices: tuple[Any, ...] = ()
    """Values a user can be advised to choose (the table's grid and the resolver's nearest
    configs); empty means all of :attr:`values`. ``params=fp16+bf16`` is a contradiction the
    table can only reject, never advise."""
    config_path: tuple[str, ...] | None = None
    """The nested config keys that hold the value, when one key does; ``None`` when not set in
    the config (``pipeline``) or set through several keys (``params``: see ``value_configs``)."""
    value_configs: Mapping[Any, Mapping[str, Any]] = field(default_factory=FrozenDict)
    """The config fragment that selects each value, for dimensions without one key."""
    shown: Mapping[Any, str] = field(default_factory=FrozenDict)
    """How a value is shown in a grid heading, where it differs from its spelling."""
    advice: Mapping[Any, str] = field(default_factory=FrozenDict)
    """How the resolver advises a value, where the config fragment that selects it holds a
    placeholder (a shard group size stands for the user's own)."""
    requires: Mapping[str, Any] = field(default_factory=FrozenDict)
    """Where the dimension means anything (``fp8_recipe``: ``fp8`` true); elsewhere the rules
    ignore it (they do not name it) and the config reader warns that it has no effect."""
    read: Callable[[PrecisionConfig], Any] | None = None
    """A feature dimension's value in a loaded config; None for the core dimensions, whose
    values ``_effective.py`` works out with the rules file's defaults."""
    attributes: Mapping[str, Callable[[Any], Any]] = field(default_factory=FrozenDict)
    """The plan's attributes derived from the value (each also a ``to_dict`` key): name ->
    function of the value. Empty means one attribute, :attr:`name`, holding the value."""
    origin_key: str = ""
    """The plan's ``origins`` key of the value; empty means the first of :attr:`attributes`."""
    label: str = ""
    """Its row's label in ``explain()``; empty means :attr:`title`."""
    described: Mapping[Any, str] = field(default_factory=FrozenDict)
    """How ``explain()`` writes a value, where it differs from its spelling."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "attributes", freeze(self.attributes or {self.name: _same}))
        object.__setattr__(self, "origin_key", self.origin_key or next(iter(self.attributes)))
        object.__setattr__(self, "label", self.label or self.title)
        object.__setattr__(self, "described", freeze(self.described))
        object.__setattr__(self, "choices", self.choices or self.values)
        object.__setattr__(self, "value_configs", freeze(self.value_configs))
        object.__setattr__(self, "shown", freeze(self.shown))
        object.__setattr__(self, "advice", freeze(self.advice))
        object.__setattr__(self, "requires", freeze(self.requires))

    def show(self, value: Any) -> str:
        return self.shown.get(value, value_text(value))

    def describe(self, value: Any) -> str:
        """``value`` as ``explain()`` writes it."""
        return self.described.get(value, value_text(value))

    def origin(self, value: Any) -> str:
        """Where a feature's ``value`` came from, as ``explain()`` prints it after ``<-``."""
        if value == self.default_value:
            return f"default: {self.default}"
        return f"config: {self.config_key}"

    def config_for(self, value: Any) -> dict[str, Any]:
        """The config fragment a user writes to select ``value`` (``{}`` when not a config key)."""
        if value in self.value_configs:
            return _thaw(self.value_configs[value])
        if self.config_path is None:
            return {}
        fragment: dict[str, Any] = {self.config_path[-1]: value}
        for key in reversed(self.config_path[:-1]):
            fragment = {key: fragment}
        return fragment

    def setting(self, value: Any) -> str:
        """The change that selects ``value``, as ``key=value`` pairs for advice."""
        if value in self.advice:
            return self.advice[value]
        if self.config_path is None and not self.value_configs:
            return f"{self.config_key}={value}"
        return ", ".join(f"{k}={value_text(v)}" for k, v in _flat(self.config_for(value)))


def _same(value: Any) -> Any:
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    return value


def _flat(fragment: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in fragment.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


_DTYPE_VALUES = ("fp32", "fp16", "bf16")

PARAMS = Dimension(
    name="params",
    values=("fp32", "fp16", "bf16", "fp16+bf16"),
    choices=_DTYPE_VALUES,
    doc="the parameter dtype; fp16+bf16 when both 16-bit modes are on (a contradiction)",
    config_key="bf16.enabled / fp16.enabled",
    default="fp32 (neither bf16 nor fp16 enabled)",
    default_value="fp32",
    title="params",
    # Both 16-bit modes on is an Error plan; its parameters are fp16 (DeepSpeed's order).
    attributes={"param_dtype": lambda value: DTYPES["fp16" if value == "fp16+bf16" else value]},
    label="parameters",
    described={"fp16+bf16": "fp16"},
    value_configs={
        "fp32": {"bf16": {"enabled": False}, "fp16": {"enabled": False}},
        "fp16": {"fp16": {"enabled": True}, "bf16": {"enabled": False}},
        "bf16": {"bf16": {"enabled": True}, "fp16": {"enabled": False}},
        "fp16+bf16": {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
    },
)
ACCUM = Dimension(
    name="accum",
    values=_DTYPE_VALUES,
    doc="the dtype in which micro-batch gradients are summed",
    config_key="gradient_accumulation_dtype.dtype",
    default="the rules file's defaults.grad_accum_dtype, by parameter dtype",
    title="accum",
    config_path=("gradient_accumulation_dtype", "dtype"),
    attributes={"grad_accum_dtype": DTYPES.__getitem__},
    label="gradient accumulation",
)
SHARDED = Dimension(
    name="sharded",
    values=(False, True),
    doc="whether each rank keeps only its shard of the accumulator",
    config_key="gradient_accumulation_dtype.sharded",
    default="the rules file's defaults.accumulator_sharded, by ZeRO stage",
    title="sharded",
    config_path=("gradient_accumulation_dtype", "sharded"),
    attributes={"accumulator_sharded": _same},
    label="accumulator",
    described={True: "sharded", False: "whole"},
)
STAGE = Dimension(
    name="stage",
    values=(0, 1, 2, 3),
    doc="the ZeRO stage",
    config_key="zero_optimization.stage",
    default="0 (DeepSpeed's default)",
    default_value=0,
    title="ZeRO stage",
    config_path=("zero_optimization", "stage"),
    shown={0: "ZeRO 0", 1: "ZeRO 1", 2: "ZeRO 2", 3: "ZeRO 3"},
    attributes={"zero_stage": _same},
)
PIPELINE = Dimension(
    name="pipeline",
    values=(False, True),
    doc="whether the caller runs pipeline parallelism (not part of the config file)",
    config_key="pipeline_parallel",
    default="False (the resolve() argument)",
    default_value=False,
    title="pipeline",
    shown={False: "", True: "+ PP"},
    attributes={"pipeline_parallel": _same},
    label="pipeline parallel",
    described={False: "no", True: "yes"},
)
COMM = Dimension(
    name="comm",
    values=_DTYPE_VALUES,
    doc="the dtype of gradients on the wire",
    config_key="communication_data_type",
    default="the rules file's defaults.communication_data_type",
    title="comm",
    config_path=("communication_data_type",),
    attributes={"comm_dtype": DTYPES.__getitem__},
    label="communication",
)
REDUCTION = Dimension(
    name="reduction",
    values=("collective", "fp32_sum"),
    doc="how 16-bit gradients are summed: the backend's collective, or an all-to-all summed "
    "in fp32 by the receiver",
    config_key="communication_reduction",
    default="collective",
    default_value="collective",
    title="reduction",
    config_path=("communication_reduction",),
    attributes={"comm_reduction": _same},
)

# --- the layout of the data-parallel group ----------------------------------------------------
WIRES_ACROSS = ("fp32", "bf16", "fp16", "int8", "fp8")
"""Wire formats between shard groups: a dtype, or int8 / fp8 blocks (one byte a value and one
fp32 scale per 256 values) summed in fp32 by the receiver."""


def shard_groups_value(shard_group_size: int | None, wire_across: str | None) -> str:
    """The ``shard_groups`` value of a layout: ``flat`` without shard groups, ``hybrid`` with
    them and the communication dtype across, ``hybrid_<wire>`` with ``wire`` across."""
    if shard_group_size is None:
        return "flat"
    return "hybrid" if wire_across is None else f"hybrid_{wire_across}"


def _layout_config(value: str) -> dict[str, Any]:
    if value == "flat":
        return {
            "zero_optimization": {"shard_group_size": None},
            "communication_data_type_across_groups": None,
        }
    wire = value.partition("_")[2] or None
    return {
        "zero_optimization": {"shard_group_size": 2},
        "communication_data_type_across_groups": wire,
    }


# One dimension, not a layout and a wire apart: a wire across groups exists only in a hybrid
# layout, so "flat with an int8 wire across" is no combination (the config reader refuses it).
SHARD_GROUPS = Dimension(
    name="shard_groups",
    values=("flat", "hybrid", *(f"hybrid_{wire}" for wire in WIRES_ACROSS)),
    doc="the layout of the data-parallel group: flat (states sharded over every rank, every "
    "collective spans the group) or hybrid (sharded within groups of shard_group_size "
    "consecutive ranks, replicated across the groups; the reduction runs within the group, "
    "then across); hybrid_<wire>: that wire across groups (else the communication dtype)",
    config_key="zero_optimization.shard_group_size / communication_data_type_across_groups",
    default="flat (no shard_group_size)",
    default_value="flat",
    title="shard groups",
    value_configs={value: _layout_config(value) for value in ("flat", "hybrid")}
    | {f"hybrid_{wire}": _layout_config(f"hybrid_{wire}") for wire in WIRES_ACROSS},
    shown={"hybrid": "hybrid"} | {f"hybrid_{w}": f"hybrid, {w} across" for w in WIRES_ACROSS},
    advice={
        "flat": "zero_optimization.shard_group_size=None, "
        "communication_data_type_across_groups=None",
        "hybrid": "zero_optimization.shard_group_size=S (ranks per shard group), "
        "communication_data_type_across_groups=None",
    }
    | {
        f"hybrid_{w}": "zero_optimization.shard_group_size=S (ranks per shard group), "
        f"communication_data_type_across_groups={w}"
        for w in WIRES_ACROSS
    },
    # _effective.py drops a wire across that is the communication dtype (no other wire).
    read=lambda config: shard_groups_value(config.shard_group_size, config.wire_across_groups),
    origin_key="shard_group_size",
)

# --- feature dimensions ------------------------------------------------------------------------
# DeepSpeed settings that change numbers or memory and that dtypeplan does not implement (yet).
# Each has a "not used" value (``default_value``), which every config that does not mention it
# gets; the table decides every other value (NotSupported or Error, each with its reason). The
# "not used" value is the only one advised (``choices``), with the config that selects it.
MASTER = Dimension(
    name="master",
    values=("fp32", "bf16", "bf16_sr", "bf16_kahan", "fp16"),
    doc="the dtype of the master weights and, for bf16, how each fp32 update is rounded into "
    "them: bf16 to nearest, bf16_sr stochastically, bf16_kahan with a bf16 compensation buffer",
    config_key="master_weights / bf16.bf16_master_weights_and_grads / "
    "fp16.fp16_master_weights_and_grads",
    default="fp32",
    default_value="fp32",
    choices=("fp32",),
    title="master weights",
    value_configs={
        "fp32": {
            "bf16": {"bf16_master_weights_and_grads": False},
            "fp16": {"fp16_master_weights_and_grads": False},
        },
        "bf16": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "bf16_sr": {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
        },
        "bf16_kahan": {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "kahan"},
        },
        "fp16": {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
    },
    shown={"bf16": "bf16 (nearest)", "bf16_sr": "bf16 (stochastic)", "bf16_kahan": "bf16 (Kahan)"},
    read=lambda config: config.master_weights_dtype,
    attributes={
        "master_dtype": lambda value: DTYPES[MASTER_ROUNDING[value][0]],
        "master_rounding": lambda value: MASTER_ROUNDING[value][1],
    },
)

MASTER_ROUNDING: FrozenDict[str, tuple[str, str]] = FrozenDict(
    {
        "fp32": ("fp32", "nearest"),
        "bf16": ("bf16", "nearest"),
        "bf16_sr": ("bf16", "stochastic"),
        "bf16_kahan": ("bf16", "kahan"),
        "fp16": ("fp16", "nearest"),
    }
)
"""Each master value as (dtype name, rounding of the fp32 update into that dtype)."""
STATE_DTYPES = tuple(FORMATS)
"""How one optimizer state (a moment) can be stored: fp32; bf16 rounded to nearest; torchao's
8-bit blockwise dynamic-tree codes or fp8 e4m3 codes, each with one fp32 scale per block."""


def states_value(exp_avg: str, exp_avg_sq: str) -> str:
    """The ``states`` value of a pair of moment dtypes: one name when they agree (``fp32``),
    else ``exp_avg/exp_avg_sq`` (``bf16/fp32``: first moment bf16, second fp32)."""
    return exp_avg if exp_avg == exp_avg_sq else f"{exp_avg}/{exp_avg_sq}"


STATE_PAIRS: FrozenDict[str, tuple[str, str]] = FrozenDict(
    {
        states_value(m, v): (m, v)
        for m, v in sorted(
            itertools.product(STATE_DTYPES, STATE_DTYPES),
            key=lambda pair: (pair[0] != pair[1], STATE_DTYPES.index(pair[0])),
        )
    }
)
"""Each ``states`` value as (first moment's dtype, second moment's dtype)."""


def _states_config(value: str) -> dict[str, Any]:
    exp_avg, exp_avg_sq = STATE_PAIRS[value]
    # bf16_optimizer_states false too, so that advice merged into a config that has it wins.
    return {
        "optimizer_states": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
        "bf16": {"bf16_optimizer_states": False},
    }


STATES = Dimension(
    name="states",
    values=tuple(STATE_PAIRS),
    doc="the dtypes of the optimizer states: Adam's first moment (exp_avg) and second moment "
    "(exp_avg_sq), each fp32, bf16, int8 (torchao's 8-bit blockwise) or fp8 (torchao's e4m3 "
    "blockwise); one name when both agree, else exp_avg/exp_avg_sq",
    config_key="optimizer_states / exp_avg_dtype, exp_avg_sq_dtype / bf16.bf16_optimizer_states",
    default="fp32",
    default_value="fp32",
    choices=("fp32",),
    title="optimizer states",
    value_configs={value: _states_config(value) for value in STATE_PAIRS},
    read=lambda config: config.optimizer_states_dtype,
    attributes={
        "optimizer_states": _same,
        "exp_avg_dtype": lambda value: STATE_PAIRS[value][0],
        "exp_avg_sq_dtype": lambda value: STATE_PAIRS[value][1],
    },
    origin_key="optimizer_states_dtype",
)
AUTOCAST = Dimension(
    name="autocast",
    values=("none", "bf16", "fp16"),
    doc="torch.autocast around forward: the compute dtype of autocast-eligible ops",
    config_key="torch_autocast.enabled / torch_autocast.dtype",
    default="none",
    default_value="none",
    choices=("none",),
    title="autocast",
    value_configs={
        "none": {"torch_autocast": {"enabled": False}},
        "bf16": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
        "fp16": {"torch_autocast": {"enabled": True, "dtype": "float16"}},
    },
    read=lambda config: config.autocast,
    attributes={"autocast_dtype": lambda value: None if value == "none" else DTYPES[value]},
    origin_key="autocast",
)
OFFLOAD_OPTIMIZER = Dimension(
    name="offload_optimizer",
    values=("none", "cpu", "nvme"),
    doc="where the master weights and optimizer states live (ZeRO-Offload, ZeRO-Infinity)",
    config_key="zero_optimization.offload_optimizer.device",
    default="none",
    default_value="none",
    choices=("none",),
    title="offload optimizer",
    config_path=("zero_optimization", "offload_optimizer", "device"),
    read=lambda config: config.offload_optimizer,
)
OFFLOAD_PARAM = Dimension(
    name="offload_param",
    values=("none", "cpu", "nvme"),
    doc="where the ZeRO-3 parameter shards live between uses",
    config_key="zero_optimization.offload_param.device",
    default="none",
    default_value="none",
    choices=("none",),
    title="offload params",
    config_path=("zero_optimization", "offload_param", "device"),
    read=lambda config: config.offload_param,
)
QUANTIZED_COMMUNICATION = Dimension(
    name="quantized_communication",
    values=("none", "weights", "gradients", "both"),
    doc="ZeRO++ int8/int4 quantization of the gathered weights and/or the reduced gradients",
    config_key="zero_optimization.zero_quantized_weights / zero_quantized_gradients",
    default="none",
    default_value="none",
    choices=("none",),
    title="quantized communication",
    value_configs={
        "none": {
            "zero_optimization": {
                "zero_quantized_weights": False,
                "zero_quantized_gradients": False,
            }
        },
        "weights": {"zero_optimization": {"zero_quantized_weights": True}},
        "gradients": {"zero_optimization": {"zero_quantized_gradients": True}},
        "both": {
            "zero_optimization": {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        },
    },
    read=lambda config: config.quantized_communication,
)
HIERARCHICAL_PARTITIONING = Dimension(
    name="hierarchical_partitioning",
    values=(False, True),
    doc="ZeRO++ hpZ: a secondary copy of the parameters partitioned within each node",
    config_key="zero_optimization.zero_hpz_partition_size",
    default="false (zero_hpz_partition_size 1)",
    default_value=False,
    choices=(False,),
    title="hierarchical partitioning",
    value_configs={
        False: {"zero_optimization": {"zero_hpz_partition_size": 1}},
        True: {"zero_optimization": {"zero_hpz_partition_size": 8}},
    },
    read=lambda config: config.hierarchical_partitioning,
)
GRADIENT_PRESCALING = Dimension(
    name="gradient_prescaling",
    values=("none", "prescale", "predivide"),
    doc="dividing gradients by the world size (or a factor) before the reduction, not after",
    config_key="prescale_gradients / gradient_predivide_factor",
    default="none",
    default_value="none",
    choices=("none",),
    title="gradient prescaling",
    value_configs={
        "none": {"prescale_gradients": False, "gradient_predivide_factor": 1.0},
        "prescale": {"prescale_gradients": True},
        "predivide": {"gradient_predivide_factor": 2.0},
    },
    read=lambda config: config.gradient_prescaling,
)
FP8 = Dimension(
    name="fp8",
    values=(False, True),
    doc="fp8 compute: the eligible nn.Linear layers run their three matmuls in fp8 "
    "(torchao's float8 training, or MXFP8); the parameters, gradients and optimizer are as "
    "without it, so every rule that does not name fp8's own dimensions decides the rest as "
    "with fp8 off",
    config_key="fp8.enabled",
    default="false",
    default_value=False,
    title="fp8",
    config_path=("fp8", "enabled"),
    read=lambda config: config.fp8,
)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``) and MXFP8
(e4m3 values, one power-of-two scale per 32 values along the contraction)."""
FP8_RECIPE = Dimension(
    name="fp8_recipe",
    values=FP8_RECIPES,
    doc="how fp8 compute scales its operands: tensorwise (one fp32 scale per tensor, the "
    "fastest, the only one with an fp8 weight all-gather), rowwise (a scale per row: more "
    "accurate), rowwise_with_gw_hp (rowwise, the weight gradient in high precision), mxfp8 "
    "(a power-of-two scale per 32 values; native on SM100+)",
    config_key="fp8.recipe",
    default="tensorwise (torchao's and Accelerate's default, the fastest)",
    default_value="tensorwise",
    title="fp8 recipe",
    config_path=("fp8", "recipe"),
    requires={"fp8": True},
    read=lambda config: config.fp8_recipe,
)
FP8_ALL_GATHER = Dimension(
    name="fp8_all_gather",
    values=("param_dtype", "fp8"),
    doc="the dtype ZeRO-3 all-gathers the converted layers' weights in: the parameter dtype, "
    "or fp8 (e4m3 with the tensorwise scale computed after each step: half of bf16's bytes)",
    config_key="fp8.all_gather",
    default="param_dtype",
    default_value="param_dtype",
    title="fp8 weight all-gather",
    config_path=("fp8", "all_gather"),
    requires={"fp8": True},
    read=lambda config: config.fp8_all_gather,
)
FP8_EXECUTION = Dimension(
    name="fp8_execution",
    values=("native", "emulated", "unavailable"),
    doc="how the fp8 matmuls run: native (the device's fp8 tensor cores: SM89+, MXFP8 SM100+), "
    "emulated (fp8 rounding, the matmul in high precision: any device, slower), unavailable "
    "(fp8.emulate false on a device without the recipe's kernels)",
    config_key="fp8.emulate",
    default="auto: native where the device has the recipe's kernels, else emulated",
    default_value="native",
    choices=("native", "emulated"),
    title="fp8 execution",
    value_configs={
        "native": {"fp8": {"emulate": "auto"}},
        "emulated": {"fp8": {"emulate": True}},
        "unavailable": {"fp8": {"emulate": False}},
    },
    advice={
        "native": "fp8.emulate=auto (native on a device with the recipe's kernels)",
        "emulated": "fp8.emulate=true",
    },
    requires={"fp8": True},
    read=lambda config: fp8_execution(config.fp8_recipe, config.fp8_emulate),
)
OPTIMIZER_KIND = Dimension(
    name="optimizer",
    values=("elementwise", "shaped"),
    doc="whether the optimizer's update of an element depends only on that element "
    "(elementwise: Adam, SGD, ...) or on the parameter's shape (shaped: Adafactor, Muon, "
    "LBFGS, SparseAdam, any class dtypeplan does not know and nobody registered, DeepSpeed's "
    "own Lamb and mup optimizers)",
    config_key="optimizer.type / build(optimizer=...) / wrap(...)",
    default="elementwise (AdamW)",
    default_value="elementwise",
    choices=("elementwise",),
    title="optimizer",
    value_configs={
        "elementwise": {"optimizer": {"type": "AdamW"}},
        "shaped": {"optimizer": {"type": "Adafactor"}},
    },
    read=lambda config: config.optimizer.kind,
    attributes={"optimizer_kind": _same},
    label="optimizer kind",
)
PARAM_ACCESS = Dimension(
    name="param_access",
    values=("flat", "owner"),
    doc="how the optimizer reaches a parameter: flat (shards of flat buffers of many "
    "parameters, for an elementwise update) or owner (each parameter whole on one rank, "
    "balanced by size, its gradient reduced to that rank and the update sent back: Muon, "
    "Adafactor, DeepSpeed's Muon, classes registered kind='whole')",
    config_key="optimizer.type / build(optimizer=...) / wrap(...)",
    default="flat (AdamW)",
    default_value="flat",
    choices=("flat",),
    title="parameter access",
    value_configs={
        "flat": {"optimizer": {"type": "AdamW"}},
        "owner": {"optimizer": {"type": "Muon"}},
    },
    read=lambda config: config.optimizer.param_access,
)
STATE_KIND = Dimension(
    name="state_kind",
    values=("moments", "step_sizes", "averaged_weights"),
    doc="what the elementwise optimizer's per-element states are: moments (running averages "
    "or sums of gradients: SGD's momentum, the Adam family, Adagrad, RMSprop, Adadelta, "
    "Adamax, NAdam, RAdam), step_sizes (Rprop: a step size per element and the last "
    "gradient's sign) or averaged_weights (ASGD's ax). A rule that does not name it decides "
    "every kind as it decides moments",
    config_key="optimizer.type / build(optimizer=...) / wrap(...)",
    default="moments (AdamW)",
    default_value="moments",
    choices=("moments",),
    title="state kind",
    value_configs={
        "moments": {"optimizer": {"type": "AdamW"}},
        "step_sizes": {"optimizer": {"type": "Rprop"}},
        "averaged_weights": {"optimizer": {"type": "ASGD"}},
    },
    read=lambda config: config.optimizer.state_kind,
)

CORE_DIMENSIONS: FrozenDict[str, Dimension] = FrozenDict(
    {dim.name: dim for dim in (PARAMS, ACCUM, SHARDED, STAGE, PIPELINE, COMM, REDUCTION)}
)
"""The dimensions dtypeplan implements: the table's grid, the parity tests' cells."""

FEATURE_DIMENSIONS: FrozenDict[str, Dimension] = FrozenDict(
    {
        dim.name: dim
        for dim in (
            MASTER,
            STATES,
            AUTOCAST,
            SHARD_GROUPS,
            OFFLOAD_OPTIMIZER,
            OFFLOAD_PARAM,
            QUANTIZED_COMMUNICATION,
            HIERARCHICAL_PARTITIONING,
            GRADIENT_PRESCALING,
            FP8,
            OPTIMIZER_KIND,
            PARAM_ACCESS,
            STATE_KIND,
            FP8_RECIPE,
            FP8_ALL_GATHER,
            FP8_EXECUTION,
        )
    }
)
"""DeepSpeed features that change numbers or memory, each with a "not used" default value."""

DIMENSIONS: FrozenDict[str, Dimension] = FrozenDict({**CORE_DIMENSIONS, **FEATURE_DIMENSIONS})
"""Every dimension by name, in display order."""

FEATURES_UNUSED: FrozenDict[str, Any] = FrozenDict(
    {name: dim.default_value for name, dim in FEATURE_DIMENSIONS.items()}
)
"""The feature dimensions at their "not used" values: what a config that sets none gets."""

COMBINATIONS = math.prod(len(dim.values) for dim in DIMENSIONS.values())
"""The number of points of the space (far too many to list: the rules loader checks rule
boxes, not points; ``dtypeplan lint`` and the docs print the figure)."""

CORE_COMBINATIONS = math.prod(len(dim.values) for dim in CORE_DIMENSIONS.values())
"""The number of points of the core dimensions, the features unused."""


def points(dimensions: Mapping[str, Dimension] = CORE_DIMENSIONS) -> Iterator[dict[str, Any]]:
    """Every combination of ``dimensions`` (the last varies fastest), the other dimensions at
    their "not used" values. The default lists the core points; the whole space is too large
    to list."""
    fixed = {name: value for name, value in FEATURES_UNUSED.items() if name not in dimensions}
    for values in itertools.product(*(dim.values for dim in dimensions.values())):
        point = {**dict(zip(dimensions, values, strict=True)), **fixed}
        yield {name: point[name] for name in DIMENSIONS}


def config_for(values: Mapping[str, Any]) -> dict[str, Any]:
    """The config a user writes to select ``values`` (dimension name -> value); dimensions left
    out, and ``pipeline`` (a ``resolve`` argument), stay at their defaults."""
    config: dict[str, Any] = {}
    for name, value in values.items():
        _merge(config, DIMENSIONS[name].config_for(value))
    return config


def _merge(into: dict[str, Any], fragment: Mapping[str, Any]) -> None:
    for key, value in fragment.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = _thaw(value)
