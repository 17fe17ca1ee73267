"""The dimensions of the configuration space: one record each, read by everything else.

A *point* of the space has one value on every dimension. Each :class:`Dimension` says, once,
what the rules loader checks (``name``, ``values``), where a config sets it (``config_key``,
:meth:`Dimension.config_for`), what applies when the config is silent (``default``), how the
resolver advises a change (:meth:`Dimension.setting`) and how the table shows it (``title``,
:meth:`Dimension.show`). The rules loader, the resolver, the table renderer and the tests all
read these records (in the spirit of torchgen's ``model.py``); adding a dimension means adding
one record here, one key to the rules schema and the code in the resolver that derives its
value from a config.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dtypeplan.resolver._frozen import FrozenDict, freeze

__all__ = [
    "ACCUM",
    "COMBINATIONS",
    "COMM",
    "DIMENSIONS",
    "Dimension",
    "PARAMS",
    "PIPELINE",
    "Point",
    "config_for",
    "REDUCTION",
    "SHARDED",
    "STAGE",
    "points",
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", self.choices or self.values)
        object.__setattr__(self, "value_configs", freeze(self.value_configs))
        object.__setattr__(self, "shown", freeze(self.shown))

    def show(self, value: Any) -> str:
        return self.shown.get(value, value_text(value))

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
        if self.config_path is None and not self.value_configs:
            return f"{self.config_key}={value}"
        return ", ".join(f"{k}={value_text(v)}" for k, v in _flat(self.config_for(value)))


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
)
SHARDED = Dimension(
    name="sharded",
    values=(False, True),
    doc="whether each rank keeps only its shard of the accumulator",
    config_key="gradient_accumulation_dtype.sharded",
    default="the rules file's defaults.accumulator_sharded, by ZeRO stage",
    title="sharded",
    config_path=("gradient_accumulation_dtype", "sharded"),
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
)
COMM = Dimension(
    name="comm",
    values=_DTYPE_VALUES,
    doc="the dtype of gradients on the wire",
    config_key="communication_data_type",
    default="the rules file's defaults.communication_data_type",
    title="comm",
    config_path=("communication_data_type",),
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
)

DIMENSIONS: FrozenDict[str, Dimension] = FrozenDict(
    {dim.name: dim for dim in (PARAMS, ACCUM, SHARDED, STAGE, PIPELINE, COMM, REDUCTION)}
)
"""Every dimension by name, in display order."""

COMBINATIONS = math.prod(len(dim.values) for dim in DIMENSIONS.values())
"""The number of points of the space; also the most rules a valid table can hold, since every
rule matches at least one point and no point is matched twice."""


def points() -> Iterator[dict[str, Any]]:
    """Every point of the space; the last dimension varies fastest."""
    for values in itertools.product(*(dim.values for dim in DIMENSIONS.values())):
        yield dict(zip(DIMENSIONS, values, strict=True))


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
