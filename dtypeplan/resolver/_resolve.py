"""``resolve``: config + rules table -> :class:`PrecisionPlan`."""

from __future__ import annotations

import os
from typing import Any

from dtypeplan.resolver._config import PrecisionConfig, load_config
from dtypeplan.resolver._plan import DTYPES, Alternative, PrecisionPlan, Status
from dtypeplan.resolver._rules import DIMENSIONS, RuleTable, load_rules

__all__ = ["resolve", "resolve_config"]

MAX_ALTERNATIVES = 5

# How each dimension is changed in a config, for the "nearest supported configs" advice.
_SETTINGS = {
    "model": lambda v: {
        "fp32": "bf16.enabled=false, fp16.enabled=false",
        "fp16": "fp16.enabled=true, bf16.enabled=false",
        "bf16": "bf16.enabled=true, fp16.enabled=false",
    }[v],
    "accum": lambda v: f"gradient_accumulation_dtype.dtype={v}",
    "sharded": lambda v: f"gradient_accumulation_dtype.sharded={'true' if v else 'false'}",
    "stage": lambda v: f"zero_optimization.stage={v}",
    "pipeline": lambda v: f"pipeline_parallel={v}",
    "comm": lambda v: f"communication_data_type={v}",
    "reduction": lambda v: f"communication_reduction={v}",
}


def resolve(
    config: dict[str, Any] | str | os.PathLike[str],
    pipeline_parallel: bool = False,
    rules: str | os.PathLike[str] | None = None,
) -> PrecisionPlan:
    """Validate ``config``, look its combination up in the rules table and return the plan.

    Total for schema-valid configs: an unsupported or contradictory combination gives a plan
    whose status says so; only an invalid config (:class:`PrecisionConfigError`) or an invalid
    rules file (:class:`RulesError`) raises.
    """
    return resolve_config(
        load_config(config), pipeline_parallel=pipeline_parallel, table=load_rules(rules)
    )


def resolve_config(
    config: PrecisionConfig, *, pipeline_parallel: bool, table: RuleTable
) -> PrecisionPlan:
    name = os.path.basename(table.path)
    defaults = table.defaults
    origins: dict[str, str] = {}

    if config.bf16 and config.fp16:
        model = "fp16+bf16"
    else:
        model = "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32"
    origins["param_dtype"] = (
        "$.bf16.enabled and $.fp16.enabled"
        if model == "fp16+bf16"
        else "$.bf16.enabled"
        if config.bf16
        else "$.fp16.enabled"
        if config.fp16
        else "default (neither bf16 nor fp16 enabled)"
    )
    # Both 16-bit modes on is an Error plan; its other defaults follow fp16 (DeepSpeed's order).
    model_for_defaults = "fp16" if model == "fp16+bf16" else model

    stage = config.zero_stage if config.zero_stage is not None else 0
    origins["zero_stage"] = (
        "$.zero_optimization.stage" if config.zero_stage is not None else "default (DeepSpeed's 0)"
    )

    if config.grad_accum_dtype is not None:
        accum = config.grad_accum_dtype
        origins["grad_accum_dtype"] = config.grad_accum_dtype_key or "config"
    else:
        accum = defaults.grad_accum_dtype[model_for_defaults]
        where = f"{name}:{defaults.lines['grad_accum_dtype']}"
        origins["grad_accum_dtype"] = f"default for {model_for_defaults} parameters ({where})"

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
        rule = defaults.communication_data_type
        comm = accum if rule == "accum" else model_for_defaults if rule == "model" else rule
        what = {"accum": "the accumulation dtype", "model": "the parameter dtype"}.get(rule, rule)
        origins["comm_dtype"] = (
            f"default: {what} ({name}:{defaults.lines['communication_data_type']})"
        )

    origins["comm_reduction"] = (
        "$.communication_reduction" if config.comm_reduction != "collective" else "default"
    )
    origins["master_dtype"] = "fixed: master weights are always fp32"
    origins["pipeline_parallel"] = f"resolve(pipeline_parallel={pipeline_parallel})"
    origins["loss_scaling"] = "$.fp16" if model == "fp16" else "off without fp16"
    origins["optimizer"] = "$.optimizer" if config.optimizer_given else "default (AdamW, lr 1e-3)"
    origins["gradient_clipping"] = (
        "$.gradient_clipping" if config.gradient_clipping else "default (off)"
    )
    origins["check_nonfinite"] = (
        "always on for fp16"
        if model == "fp16"
        else ("$.check_nonfinite" if config.check_nonfinite else "default (off)")
    )

    point = {
        "model": model,
        "accum": accum,
        "sharded": sharded,
        "stage": stage,
        "pipeline": bool(pipeline_parallel),
        "comm": comm,
        "reduction": config.comm_reduction,
    }
    rule = table.lookup(point)
    status = Status(rule.status)
    param_dtype = DTYPES[model_for_defaults]
    return PrecisionPlan(
        status=status,
        implementation=rule.implementation if status == Status.OK else None,
        rule_id=rule.id,
        rule_location=table.location(rule),
        reason=rule.reason,
        param_dtype=param_dtype,
        grad_accum_dtype=DTYPES[accum],
        accumulator_sharded=sharded,
        comm_dtype=DTYPES[comm],
        comm_reduction=config.comm_reduction,
        zero_stage=stage,
        pipeline_parallel=bool(pipeline_parallel),
        loss_scaling=config.loss_scaling,
        optimizer=config.optimizer,
        gradient_clipping=config.gradient_clipping,
        reduce_bucket_size=config.reduce_bucket_size,
        check_nonfinite=config.check_nonfinite,
        origins=origins,
        warnings=tuple(_warnings(point, config)),
        ignored_keys=config.ignored_keys,
        alternatives=() if status == Status.OK else _alternatives(point, table),
    )


def _warnings(point: dict[str, Any], config: PrecisionConfig) -> list[str]:
    model, accum, comm = point["model"], point["accum"], point["comm"]
    found = []
    if model in DTYPES and accum != "fp32" and accum != model:
        found.append(
            f"gradients of {model} parameters are summed in {accum}, which keeps fewer "
            f"{'mantissa' if accum == 'bf16' else 'exponent'} bits than {model}: expect a less "
            "precise (or overflowing) sum; fp32 accumulation avoids it"
        )
    elif model == "fp32" and accum != "fp32":
        found.append(
            f"fp32 gradients are summed in {accum}: precision is lost at every micro-batch"
        )
    if DTYPES[comm].itemsize < DTYPES[accum].itemsize:
        found.append(f"gradients are rounded from {accum} to {comm} on the wire")
    if comm == "fp16" and model == "bf16":
        found.append(
            "bf16 gradients sent as fp16 may overflow (fp16 tops out at 65504) or flush to zero"
        )
    if config.comm_reduction == "fp32_sum" and comm == "fp32":
        found.append("communication_reduction fp32_sum has no effect with fp32 on the wire")
    offload = [k for k in config.ignored_keys if "offload" in k]
    if offload:
        found.append(f"{', '.join(offload)}: dtypeplan does not offload; the setting is ignored")
    return found


def _alternatives(point: dict[str, Any], table: RuleTable) -> tuple[Alternative, ...]:
    best: list[tuple[int, list[str], Any]] = []
    for candidate in table.points():
        if candidate["model"] == "fp16+bf16":
            continue
        rule = table.lookup(candidate)
        if rule.status != "OK":
            continue
        changed = [dim for dim in DIMENSIONS if candidate[dim] != point[dim]]
        best.append((len(changed), [_SETTINGS[d](candidate[d]) for d in changed], rule))
    if not best:
        return ()
    fewest = min(distance for distance, _, _ in best)
    chosen = [entry for entry in best if entry[0] == fewest][:MAX_ALTERNATIVES]
    return tuple(
        Alternative(changes=tuple(changes), rule_id=rule.id, implementation=rule.implementation)
        for _, changes, rule in chosen
    )
