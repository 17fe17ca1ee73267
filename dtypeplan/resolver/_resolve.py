"""``resolve``: config + rules table -> :class:`PrecisionPlan`.

``load_config`` (``_load.py``) reads the config; ``_effective.py`` works out each setting's
value and origin; here they become the table's point, the point its rule, and the rule with
the values the plan.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Collection, Mapping
from typing import Any

from dtypeplan._dtypes import DTYPES
from dtypeplan.resolver._config import PrecisionConfig
from dtypeplan.resolver._differences import ALL_STAGES, deepspeed_differences
from dtypeplan.resolver._dimensions import DIMENSIONS
from dtypeplan.resolver._effective import Effective, effective_values
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._load import load_config
from dtypeplan.resolver._plan import Alternative, PrecisionPlan, Resolution, Status
from dtypeplan.resolver._rules import Implementations, Rule, RuleTable, load_rules

__all__ = ["resolve", "resolve_config"]

MAX_ALTERNATIVES = 5


def resolve(
    config: dict[str, Any] | str | os.PathLike[str],
    pipeline_parallel: bool = False,
    rules: str | os.PathLike[str] | None = None,
    auto: Mapping[str, Any] | None = None,
    strict: bool = False,
    *,
    implementations: Implementations | Collection[str] | None = None,
) -> PrecisionPlan:
    """Validate ``config``, look its combination up in the rules table and return the plan.

    Total for schema-valid configs: an unsupported or contradictory combination gives a plan
    whose status says so; only an invalid config (:class:`PrecisionConfigError`) or an invalid
    rules file (:class:`RulesError`) raises. ``auto`` fills the config's ``"auto"`` values
    (dotted path -> value; the rest take the HF Trainer's defaults); ``strict`` makes every
    unknown key an error. ``implementations``: the registered implementations a rule may send
    combinations to, with what each declares it serves (``dtypeplan.resolve`` passes the
    registry's); None: unchecked.
    """
    return resolve_config(
        load_config(config, auto=auto, strict=strict),
        pipeline_parallel=pipeline_parallel,
        table=load_rules(rules, implementations=implementations),
    )


def resolve_config(
    config: PrecisionConfig, *, pipeline_parallel: bool, table: RuleTable
) -> PrecisionPlan:
    """The plan of a loaded config: effective values -> the table's point -> its rule -> the
    plan."""
    effective = effective_values(config, pipeline_parallel=pipeline_parallel, table=table)
    point = {
        "params": effective.params,
        "accum": effective.accum,
        "sharded": effective.sharded,
        "stage": effective.stage,
        "pipeline": bool(pipeline_parallel),
        "comm": effective.comm,
        "reduction": config.comm_reduction,
        **effective.features,
    }
    rule = table.lookup(point)
    return _plan(config, effective, point, rule, table, pipeline_parallel=pipeline_parallel)


def _plan(
    config: PrecisionConfig,
    effective: Effective,
    point: dict[str, Any],
    rule: Rule,
    table: RuleTable,
    *,
    pipeline_parallel: bool,
) -> PrecisionPlan:
    """The plan: the rule's decision, the point (from which the plan derives each
    dimension's attributes) and the config's settings that no dimension holds."""
    origins, scaled = effective.origins, effective.scaled
    ok = rule.status == Status.OK
    return PrecisionPlan(
        status=rule.status,
        implementation=rule.implementation if ok else None,
        single_process_implementation=(rule.single_process_implementation or rule.implementation)
        if ok
        else None,
        rule_id=rule.id,
        rule_location=table.location(rule),
        reason=rule.explanation,
        point=FrozenDict(point),
        hpz_partition_size=config.hpz_partition_size,
        shard_group_size=config.shard_group_size,
        wire_across_groups=config.wire_across_groups,
        fp8_exclude_modules=config.fp8_exclude_modules,
        loss_scaling=config.loss_scaling if scaled else None,
        optimizer=config.optimizer,
        gradient_clipping=config.gradient_clipping,
        reduce_bucket_size=config.reduce_bucket_size,
        check_nonfinite=config.check_nonfinite or scaled,
        collective_timeout_s=config.collective_timeout_s,
        origins=FrozenDict(origins),
        warnings=tuple(_warnings(point, config)),
        ignored_keys=_still_ignored(config, point["stage"]),
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


def _still_ignored(config: PrecisionConfig, stage: int) -> tuple[str, ...]:
    """The ignored keys but those ``explain()`` states as differences at ``stage``
    (``zero_settings``): a key with which DeepSpeed changes memory is not listed as changing
    neither. Each is matched under every spelling DeepSpeed reads (``stage3_`` aliases)."""
    names = [n for n, _ in config.zero_settings if stage == 3 or n in ALL_STAGES]
    stated = {f"$.zero_optimization.{n}" for n in names}
    stated |= {f"$.zero_optimization.stage3_{n}" for n in names if "." not in n}
    if "gather_16bit_weights_on_model_save" in names:
        stated.add("$.zero_optimization.stage3_gather_fp16_weights_on_model_save")
    return tuple(path for path in config.ignored_keys if path not in stated)
