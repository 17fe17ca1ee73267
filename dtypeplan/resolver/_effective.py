"""Effective values: a config and the rules table's defaults -> the value that runs for each
setting, and where it came from.

Every setting the config may leave out is picked once, by :func:`_pick`: the config's value and
the key that gave it, else the table's default and the line it is written on. The origins are
what ``explain()`` prints after each ``<-`` and what ``_differences.py`` quotes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dtypeplan.resolver._auto import SHARD_GROUP_SIZE
from dtypeplan.resolver._client_optimizer import ClientOptimizerConfig
from dtypeplan.resolver._config import PrecisionConfig
from dtypeplan.resolver._dimensions import (
    FEATURE_DIMENSIONS,
    PARAMS,
    REDUCTION,
    STAGE,
    Dimension,
    shard_groups_value,
)
from dtypeplan.resolver._fp8_device import fp8_device_text, fp8_execution, fp8_native
from dtypeplan.resolver._rules import RuleTable

__all__ = ["Effective", "effective_values", "fp8_execution", "fp8_native"]

T = TypeVar("T")

# "auto" config paths -> the origins entry of the effective value they decide.
_AUTO_ORIGINS = {
    "bf16.enabled": "param_dtype",
    "fp16.enabled": "param_dtype",
    "gradient_clipping": "gradient_clipping",
    "data_types.grad_accum_dtype": "grad_accum_dtype",
    "communication_data_type": "comm_dtype",
}


@dataclass(frozen=True, kw_only=True)
class Effective:
    """The values a config resolves to before the table is asked, with their origins."""

    params: str
    """The ``params`` dimension: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp16+bf16"``."""
    param_name: str
    """The parameters' dtype name (``"fp16"`` for ``"fp16+bf16"``, DeepSpeed's order)."""
    fp16: bool
    scaled: bool
    """Whether the loss is scaled: fp16 parameters, or fp16 autocast."""
    stage: int
    accum: str
    sharded: bool
    comm: str
    features: dict[str, Any]
    """The feature dimensions' values (see ``_dimensions.py``)."""
    origins: dict[str, str]


def _pick(given: T | None, path: str, default: Callable[[], T], where: str) -> tuple[T, str]:
    """The config's value and the key that gave it, else the default and where it is set."""
    if given is not None:
        return given, path
    return default(), where


def effective_values(
    config: PrecisionConfig, *, pipeline_parallel: bool, table: RuleTable
) -> Effective:
    """Each setting's effective value and origin, in the order ``explain()`` lists them."""
    name = os.path.basename(table.path)
    defaults = table.defaults
    origins: dict[str, str] = {}
    params, origins["param_dtype"] = _params(config)
    # Both 16-bit modes on is an Error plan; its other defaults follow fp16 (DeepSpeed's order).
    param_name = "fp16" if params == "fp16+bf16" else params
    fp16 = param_name == "fp16"
    # fp16 autocast computes backward in fp16 from fp32 parameters: its gradients underflow
    # without a loss scale, so it is scaled as fp16 parameters are (the fp16 block's scaler).
    scaled = fp16 or config.autocast == "fp16"
    stage, origins["zero_stage"] = _pick(
        config.zero_stage,
        "$.zero_optimization.stage",
        lambda: STAGE.default_value,
        f"default: {STAGE.default}",
    )
    accum, origins["grad_accum_dtype"] = _pick(
        config.grad_accum_dtype,
        config.grad_accum_dtype_key or "config",
        lambda: defaults.grad_accum_dtype[param_name],
        f"default for {param_name} parameters ({name}:{defaults.lines['grad_accum_dtype']})",
    )
    sharded, origins["accumulator_sharded"] = _pick(
        config.accumulator_sharded,
        "$.gradient_accumulation_dtype.sharded",
        lambda: defaults.accumulator_sharded[stage],
        f"default for ZeRO stage {stage} ({name}:{defaults.lines['accumulator_sharded']})",
    )
    comm_default = defaults.communication_data_type
    what = {"accum": "the accumulation dtype", "params": "the parameter dtype"}
    comm, origins["comm_dtype"] = _pick(
        config.comm_dtype,
        "$.communication_data_type",
        lambda: {"accum": accum, "params": param_name}.get(comm_default, comm_default),
        f"default: {what.get(comm_default, comm_default)} "
        f"({name}:{defaults.lines['communication_data_type']})",
    )
    origins["comm_reduction"] = (
        "$.communication_reduction"
        if config.comm_reduction != REDUCTION.default_value
        else f"default: {REDUCTION.default}"
    )
    features = _features(config, comm, origins)
    origins.update(_setting_origins(config, features, pipeline_parallel, fp16, scaled))
    _add_auto_origins(config, origins)
    return Effective(
        params=params,
        param_name=param_name,
        fp16=fp16,
        scaled=scaled,
        stage=stage,
        accum=accum,
        sharded=sharded,
        comm=comm,
        features=features,
        origins=origins,
    )


def _params(config: PrecisionConfig) -> tuple[str, str]:
    """The ``params`` dimension's value and its origin."""
    if config.bf16 and config.fp16:
        return "fp16+bf16", "$.bf16.enabled and $.fp16.enabled"
    if config.bf16:
        return "bf16", "$.bf16.enabled"
    if config.fp16:
        return "fp16", "$.fp16.enabled"
    return PARAMS.default_value, f"default: {PARAMS.default}"


def _features(config: PrecisionConfig, comm: str, origins: dict[str, str]) -> dict[str, Any]:
    """The feature dimensions' values of ``config`` (each record's ``read``), their origins
    added to ``origins``."""
    features = {name: _read(dim, config) for name, dim in FEATURE_DIMENSIONS.items()}
    if config.wire_across_groups == comm:
        # The wire across named as the communication dtype is no other wire: the same
        # combination as leaving it unset (ZeRO-3 runs exactly that one, FSDP2's reduce dtype).
        features["shard_groups"] = shard_groups_value(config.shard_group_size, None)
    for name, value in features.items():
        dim = FEATURE_DIMENSIONS[name]
        origins[dim.origin_key] = dim.origin(value)
    origins["fp8_execution"] = f"fp8.emulate {config.fp8_emulate}, the device: {fp8_device_text()}"
    if config.shard_group_size is not None:
        origins["shard_group_size"] = "$.zero_optimization.shard_group_size"
        origins["wire_across_groups"] = (
            config.wire_across_groups_key or "default: the communication dtype"
        )
    for auto in config.auto_values:
        if auto.path == SHARD_GROUP_SIZE and auto.value is not None:
            origins["shard_group_size"] += f' "auto" <- {auto.source}'
    return features


def _read(dim: Dimension, config: PrecisionConfig) -> Any:
    assert dim.read is not None, f"the feature dimension {dim.name} says how a config sets it"
    return dim.read(config)


def _setting_origins(
    config: PrecisionConfig,
    features: dict[str, Any],
    pipeline_parallel: bool,
    fp16: bool,
    scaled: bool,
) -> dict[str, str]:
    """The origins of the settings that are no table dimension (and the optimizer's kind)."""
    return {
        # The optimizer's kind comes from its class, wherever the class came from.
        "optimizer_kind": (
            f"{config.optimizer.type} is {features['optimizer']}: "
            f"{config.optimizer.kind_reason} (resolver/_optimizer_kind.py)"
        ),
        "pipeline_parallel": f"resolve(pipeline_parallel={pipeline_parallel})",
        "loss_scaling": (
            "$.fp16"
            if fp16
            else "$.fp16 block's scaler, for fp16 autocast (torch_autocast.dtype)"
            if scaled
            else "off without fp16"
        ),
        "optimizer": (
            "the program's optimizer (build(optimizer=...) or wrap())"
            if isinstance(config.optimizer, ClientOptimizerConfig)
            else "$.optimizer"
            if config.optimizer_given
            else "default (AdamW, lr 1e-3)"
        ),
        "gradient_clipping": (
            "$.gradient_clipping" if config.gradient_clipping_given else "default (off)"
        ),
        "check_nonfinite": (
            "always on for fp16"
            if fp16
            else "always on for fp16 autocast"
            if scaled
            else ("$.check_nonfinite" if config.check_nonfinite else "default (off)")
        ),
    }


def _add_auto_origins(config: PrecisionConfig, origins: dict[str, str]) -> None:
    """An effective value that came from an ``"auto"`` says so where it is listed."""
    for auto in config.auto_values:
        key = _AUTO_ORIGINS.get(auto.path) or (
            "optimizer" if auto.path.startswith("optimizer.") else None
        )
        if key is not None and key in origins:
            origins[key] += f'; {auto.path} "auto" <- {auto.source}'
