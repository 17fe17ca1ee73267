"""``resolve``: config + rules table -> :class:`PrecisionPlan`."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Collection, Mapping
from typing import Any

from dtypeplan._dtypes import DTYPES
from dtypeplan.resolver._auto import SHARD_GROUP_SIZE
from dtypeplan.resolver._client_optimizer import ClientOptimizerConfig
from dtypeplan.resolver._config import PrecisionConfig
from dtypeplan.resolver._differences import deepspeed_differences
from dtypeplan.resolver._dimensions import (
    DIMENSIONS,
    FEATURE_DIMENSIONS,
    MASTER_ROUNDING,
    PARAMS,
    REDUCTION,
    STAGE,
    STATE_PAIRS,
    shard_groups_value,
)
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._load import load_config
from dtypeplan.resolver._plan import Alternative, PrecisionPlan, Resolution, Status
from dtypeplan.resolver._rules import RuleTable, load_rules

__all__ = ["resolve", "resolve_config"]

MAX_ALTERNATIVES = 5
# "auto" config paths -> the origins entry of the effective value they decide.
_AUTO_ORIGINS = {
    "bf16.enabled": "param_dtype",
    "fp16.enabled": "param_dtype",
    "gradient_clipping": "gradient_clipping",
    "data_types.grad_accum_dtype": "grad_accum_dtype",
    "communication_data_type": "comm_dtype",
}


def resolve(
    config: dict[str, Any] | str | os.PathLike[str],
    pipeline_parallel: bool = False,
    rules: str | os.PathLike[str] | None = None,
    auto: Mapping[str, Any] | None = None,
    strict: bool = False,
    *,
    implementations: Collection[str] | None = None,
) -> PrecisionPlan:
    """Validate ``config``, look its combination up in the rules table and return the plan.

    Total for schema-valid configs: an unsupported or contradictory combination gives a plan
    whose status says so; only an invalid config (:class:`PrecisionConfigError`) or an invalid
    rules file (:class:`RulesError`) raises. ``auto`` fills the config's ``"auto"`` values
    (dotted path -> value; the rest take the HF Trainer's defaults); ``strict`` makes every
    unknown key an error. ``implementations``: the registered names a rule may send
    combinations to (``dtypeplan.resolve`` passes the registry's); None: unchecked.
    """
    return resolve_config(
        load_config(config, auto=auto, strict=strict),
        pipeline_parallel=pipeline_parallel,
        table=load_rules(rules, implementations=implementations),
    )


def resolve_config(
    config: PrecisionConfig, *, pipeline_parallel: bool, table: RuleTable
) -> PrecisionPlan:
    name = os.path.basename(table.path)
    defaults = table.defaults
    origins: dict[str, str] = {}

    if config.bf16 and config.fp16:
        params = "fp16+bf16"
    else:
        params = "bf16" if config.bf16 else "fp16" if config.fp16 else PARAMS.default_value
    origins["param_dtype"] = (
        "$.bf16.enabled and $.fp16.enabled"
        if params == "fp16+bf16"
        else "$.bf16.enabled"
        if config.bf16
        else "$.fp16.enabled"
        if config.fp16
        else f"default: {PARAMS.default}"
    )
    # Both 16-bit modes on is an Error plan; its other defaults follow fp16 (DeepSpeed's order).
    param_name = "fp16" if params == "fp16+bf16" else params
    fp16 = param_name == "fp16"
    # fp16 autocast computes backward in fp16 from fp32 parameters: its gradients underflow
    # without a loss scale, so it is scaled as fp16 parameters are (the fp16 block's scaler).
    scaled = fp16 or config.autocast == "fp16"

    stage = config.zero_stage if config.zero_stage is not None else STAGE.default_value
    origins["zero_stage"] = (
        "$.zero_optimization.stage"
        if config.zero_stage is not None
        else f"default: {STAGE.default}"
    )

    if config.grad_accum_dtype is not None:
        accum = config.grad_accum_dtype
        origins["grad_accum_dtype"] = config.grad_accum_dtype_key or "config"
    else:
        accum = defaults.grad_accum_dtype[param_name]
        where = f"{name}:{defaults.lines['grad_accum_dtype']}"
        origins["grad_accum_dtype"] = f"default for {param_name} parameters ({where})"

    if config.accumulator_sharded is not None:
        sharded = config.accumulator_sharded
        origins["accumulator_sharded"] = "$.gradient_accumulation_dtype.sharded"
    else:
        sharded = defaults.accumulator_sharded[stage]
        origins["accumulator_sharded"] = (
            f"default for ZeRO stage {stage} ({name}:{defaults.lines['accumulator_sharded']})"
        )

    if config.comm_dtype is not None:
        comm = config.comm_dtype
        origins["comm_dtype"] = "$.communication_data_type"
    else:
        comm_default = defaults.communication_data_type
        comm = {"accum": accum, "params": param_name}.get(comm_default, comm_default)
        what = {"accum": "the accumulation dtype", "params": "the parameter dtype"}.get(
            comm_default, comm_default
        )
        origins["comm_dtype"] = (
            f"default: {what} ({name}:{defaults.lines['communication_data_type']})"
        )

    origins["comm_reduction"] = (
        "$.communication_reduction"
        if config.comm_reduction != REDUCTION.default_value
        else f"default: {REDUCTION.default}"
    )
    features = _features(config)
    if config.wire_across_groups == comm:
        # The wire across named as the communication dtype is no other wire: the same
        # combination as leaving it unset (ZeRO-3 runs exactly that one, FSDP2's reduce dtype).
        features["shard_groups"] = shard_groups_value(config.shard_group_size, None)
    for feature, value in features.items():
        dim = FEATURE_DIMENSIONS[feature]
        origins[_FEATURE_ORIGINS.get(feature, feature)] = (
            f"default: {dim.default}" if value == dim.default_value else f"config: {dim.config_key}"
        )
    if config.shard_group_size is not None:
        origins["shard_group_size"] = "$.zero_optimization.shard_group_size"
        origins["wire_across_groups"] = (
            config.wire_across_groups_key or "default: the communication dtype"
        )
    for auto in config.auto_values:
        if auto.path == SHARD_GROUP_SIZE and auto.value is not None:
            origins["shard_group_size"] += f' "auto" <- {auto.source}'
    # The optimizer's kind comes from its class, wherever the class came from.
    origins["optimizer_kind"] = (
        f"{config.optimizer.type} is {features['optimizer']}: {config.optimizer.kind_reason} "
        "(resolver/_optimizer_kind.py)"
    )
    origins["pipeline_parallel"] = f"resolve(pipeline_parallel={pipeline_parallel})"
    origins["loss_scaling"] = (
        "$.fp16"
        if fp16
        else "$.fp16 block's scaler, for fp16 autocast (torch_autocast.dtype)"
        if scaled
        else "off without fp16"
    )
    origins["optimizer"] = (
        "the program's optimizer (build(optimizer=...) or wrap())"
        if isinstance(config.optimizer, ClientOptimizerConfig)
        else "$.optimizer"
        if config.optimizer_given
        else "default (AdamW, lr 1e-3)"
    )
    origins["gradient_clipping"] = (
        "$.gradient_clipping" if config.gradient_clipping_given else "default (off)"
    )
    origins["check_nonfinite"] = (
        "always on for fp16"
        if fp16
        else "always on for fp16 autocast"
        if scaled
        else ("$.check_nonfinite" if config.check_nonfinite else "default (off)")
    )

    # An effective value that came from an "auto" says so where it is listed.
    for auto in config.auto_values:
        key = _AUTO_ORIGINS.get(auto.path) or (
            "optimizer" if auto.path.startswith("optimizer.") else None
        )
        if key is not None and key in origins:
            origins[key] += f'; {auto.path} "auto" <- {auto.source}'

    point = {
        "params": params,
        "accum": accum,
        "sharded": sharded,
        "stage": stage,
        "pipeline": bool(pipeline_parallel),
        "comm": comm,
        "reduction": config.comm_reduction,
        **features,
    }
    rule = table.lookup(point)
    status = rule.status
    ok = status == Status.OK
    return PrecisionPlan(
        status=status,
        implementation=rule.implementation if ok else None,
        single_process_implementation=(rule.single_process_implementation or rule.implementation)
        if ok
        else None,
        rule_id=rule.id,
        rule_location=table.location(rule),
        reason=rule.reason,
        param_dtype=DTYPES[param_name],
        grad_accum_dtype=DTYPES[accum],
        accumulator_sharded=sharded,
        comm_dtype=DTYPES[comm],
        comm_reduction=config.comm_reduction,
        master_dtype=DTYPES[MASTER_ROUNDING[features["master"]][0]],
        master_rounding=MASTER_ROUNDING[features["master"]][1],
        exp_avg_dtype=STATE_PAIRS[features["states"]][0],
        exp_avg_sq_dtype=STATE_PAIRS[features["states"]][1],
        autocast_dtype=None if config.autocast == "none" else DTYPES[config.autocast],
        offload_optimizer=config.offload_optimizer,
        offload_param=config.offload_param,
        quantized_communication=config.quantized_communication,
        hierarchical_partitioning=config.hierarchical_partitioning,
        shard_group_size=config.shard_group_size,
        wire_across_groups=config.wire_across_groups,
        gradient_prescaling=config.gradient_prescaling,
        fp8=config.fp8,
        optimizer_kind=features["optimizer"],
        zero_stage=stage,
        pipeline_parallel=bool(pipeline_parallel),
        loss_scaling=config.loss_scaling if scaled else None,
        optimizer=config.optimizer,
        gradient_clipping=config.gradient_clipping,
        reduce_bucket_size=config.reduce_bucket_size,
        check_nonfinite=config.check_nonfinite or scaled,
        collective_timeout_s=config.collective_timeout_s,
        origins=FrozenDict(origins),
        warnings=tuple(_warnings(point, config)),
        ignored_keys=config.ignored_keys,
        alternatives=() if ok else _alternatives(point, table),
        scheduler=config.scheduler,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        train_batch_size=config.train_batch_size,
        train_micro_batch_size_per_gpu=config.train_micro_batch_size_per_gpu,
        auto_values=config.auto_values,
        config_warnings=config.config_warnings,
        deepspeed_differences=tuple(deepspeed_differences(config, point, origins)),
        resolution=Resolution(
            config=config,
            resolve=functools.partial(
                resolve_config, pipeline_parallel=pipeline_parallel, table=table
            ),
        ),
    )


_FEATURE_ORIGINS = {
    "master": "master_dtype",
    "states": "optimizer_states_dtype",
    "shard_groups": "shard_group_size",
    "optimizer": "optimizer_kind",
}
"""The plan's ``origins`` key of a feature dimension, where it differs from its name."""


def _features(config: PrecisionConfig) -> dict[str, Any]:
    """The feature dimensions' values of ``config`` (see ``_dimensions.py``)."""
    return {
        "master": config.master_weights_dtype,
        "states": config.optimizer_states_dtype,
        "autocast": config.autocast,
        "shard_groups": shard_groups_value(config.shard_group_size, config.wire_across_groups),
        "offload_optimizer": config.offload_optimizer,
        "offload_param": config.offload_param,
        "quantized_communication": config.quantized_communication,
        "hierarchical_partitioning": config.hierarchical_partitioning,
        "gradient_prescaling": config.gradient_prescaling,
        "fp8": config.fp8,
        "optimizer": config.optimizer.kind,
    }


def _warnings(point: dict[str, Any], config: PrecisionConfig) -> list[str]:
    params, accum, comm = point["params"], point["accum"], point["comm"]
    found = []
    if params in DTYPES and accum != "fp32" and accum != params:
        found.append(
            f"gradients of {params} parameters are summed in {accum}, which keeps fewer "
            f"{'mantissa' if accum == 'bf16' else 'exponent'} bits than {params}: expect a less "
            "precise (or overflowing) sum; fp32 accumulation avoids it"
        )
    elif params == "fp32" and accum != "fp32":
        found.append(
            f"fp32 gradients are summed in {accum}: precision is lost at every micro-batch"
        )
    if DTYPES[comm].itemsize < DTYPES[accum].itemsize:
        found.append(f"gradients are rounded from {accum} to {comm} on the wire")
    if comm == "fp16" and params == "bf16":
        found.append(
            "bf16 gradients sent as fp16 may overflow (fp16 tops out at 65504) or flush to zero"
        )
    if config.comm_reduction == "fp32_sum" and comm == "fp32":
        found.append("communication_reduction fp32_sum has no effect with fp32 on the wire")
    return found


def _alternatives(point: dict[str, Any], table: RuleTable) -> tuple[Alternative, ...]:
    """The OK points with the fewest changed settings, nearest first.

    Only advisable values (``Dimension.choices``) are proposed, so a dimension whose value is
    not one (``params=fp16+bf16``, a feature in use) always changes. The search widens one
    changed dimension at a time and stops at the first distance with an OK point: a handful of
    lookups, never the whole space.
    """
    options = {
        name: [v for v in dim.choices if v != point[name]] for name, dim in DIMENSIONS.items()
    }
    forced = [name for name, dim in DIMENSIONS.items() if point[name] not in dim.choices]
    free = [name for name in DIMENSIONS if name not in forced and options[name]]
    for extra in range(len(free) + 1):
        found: list[Alternative] = []
        for chosen in itertools.combinations(free, extra):
            names = [name for name in DIMENSIONS if name in forced or name in chosen]
            for values in itertools.product(*(options[name] for name in names)):
                candidate = {**point, **dict(zip(names, values, strict=True))}
                rule = table.lookup(candidate)
                if rule.status != Status.OK:
                    continue
                assert rule.implementation is not None
                changes = tuple(
                    DIMENSIONS[n].setting(v) for n, v in zip(names, values, strict=True)
                )
                found.append(
                    Alternative(
                        changes=changes, rule_id=rule.id, implementation=rule.implementation
                    )
                )
                if len(found) == MAX_ALTERNATIVES:
                    return tuple(found)
        if found:
            return tuple(found)
    return ()
