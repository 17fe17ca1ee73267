"""Planning: which of the table's OK combinations fit a model on a fleet, and at what cost.

``plan_for(model, fleet, ...)`` runs five stages, each owned by one module:

1) ``model_sizes``: the model's parameter sizes (an ``nn.Module`` on the meta device, a
   transformers config counted by formula, or a count);
2) ``enumeration``: every OK combination of the table within the values a user chooses, for the
   optimizer class (one lookup per box of points the table decides alike);
3) ``costs``: each distinct combination's device and host bytes per rank (``plan.memory()``'s
   byte model plus activations), traffic per step by link (``plan.traffic()``'s), modelled
   communication time and expected drift (``numerics``), and whether it fits;
4) ``rank``: sorted by the objective, the Pareto front of memory, time and drift marked;
5) the finalists (the top of the ranking and the front) resolved with ``dtypeplan.resolve``:
   each must be OK and its ``plan.memory()`` / ``plan.traffic()`` equal to the figures above.

``dtypeplan plan`` (``cli.py``) prints the result (``report.py``), writes the chosen config
and draws the front.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtypeplan.planner.costs import Candidate, Coster, Workload
from dtypeplan.planner.enumeration import CHOICES, Box, choice_space, ok_points
from dtypeplan.planner.fleet import Fleet, parse_bandwidth, parse_size
from dtypeplan.planner.model_sizes import ModelSizes, model_sizes
from dtypeplan.planner.rank import OBJECTIVES, ranked

__all__ = [
    "Candidate",
    "Fleet",
    "ModelSizes",
    "OBJECTIVES",
    "Planning",
    "config_of",
    "model_sizes",
    "parse_bandwidth",
    "parse_size",
    "plan_for",
]

_DEFAULT_OPTIMIZER = "AdamW"

_COST_FREE = ("gradient_prescaling", "quantized_communication", "reduction")
"""Dimensions that change neither a figure here nor the drift model: of the values the table
allows, the first (the "not used" one where allowed) stands for the rest."""


@dataclass(frozen=True, kw_only=True)
class Planning:
    """What ``plan_for`` found."""

    sizes: ModelSizes
    fleet: Fleet
    workload: Workload
    optimizer: str
    objective: str
    fitting: tuple[Candidate, ...]
    """The combinations that fit, ranked by the objective (one per distinct cost)."""
    rejected: tuple[Candidate, ...]
    """Those that do not fit, closest first (by device bytes)."""
    ok_points: int
    """OK points of the table enumerated (before deduplication)."""
    distinct: int
    """Distinct combinations costed."""
    plans: Mapping[int, Any]
    """The resolved plan of each finalist, by its position in :attr:`fitting`."""

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def front(self) -> list[Candidate]:
        return [c for c in self.fitting if c.pareto]

    def config(self, candidate: Candidate | None = None) -> dict[str, Any]:
        """The ds_config of ``candidate`` (default: the best)."""
        chosen = candidate or self.best
        if chosen is None:
            raise ValueError("no combination fits: there is no config to write")
        return config_of(chosen, self.optimizer, self.workload, self.fleet)


def plan_for(
    model: Any,
    fleet: Fleet,
    *,
    optimizer: str = _DEFAULT_OPTIMIZER,
    micro_batch: int = 1,
    seq: int = 2048,
    micro_batches: int = 1,
    recompute: str = "auto",
    shard_group_sizes: Sequence[int] | None = None,
    objective: str = "time",
    max_drift: float | None = None,
    rules: str | os.PathLike[str] | None = None,
    resolve_top: int = 5,
    progress: Callable[[str], None] | None = None,
) -> Planning:
    """Every OK combination of the table for ``model`` on ``fleet``, costed and ranked.

    ``model``: an ``nn.Module`` (build it on the meta device), a transformers config (a
    ``config.json`` path or directory, a dict, a ``PretrainedConfig``), a parameter count or
    :class:`ModelSizes`. ``optimizer``: a ``torch.optim`` class name as a config gives it.
    ``micro_batch`` x ``seq``: each GPU's micro-batch for the activations; ``micro_batches``:
    micro-batches per step. ``recompute``: activation recomputation (none, selective, full;
    auto: for each combination the least that fits). ``shard_group_sizes``: the group sizes a
    hybrid layout is tried with (default: one node).
    ``objective``: memory, time or fidelity. ``max_drift``: the largest expected relative
    deviation of the loss accepted (``numerics.py``). ``resolve_top``: how many of the ranking, and
    of the Pareto front, are resolved and checked against ``plan.memory()`` /
    ``plan.traffic()`` (the finalists).
    """
    from dtypeplan._api import load_rules
    from dtypeplan.resolver import _optimizer_kind as kinds

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    if min(micro_batch, seq, micro_batches) < 1:
        raise ValueError("micro_batch, seq and micro_batches must be >= 1")
    sizes = model_sizes(model)
    name = kinds.canonical_name(optimizer)
    torch_class = kinds.optimizer_class(name) if name not in _deepspeed_only() else None
    fixed = {
        "pipeline": False,
        "fp8_execution": "native",
        "optimizer": kinds.optimizer_kind(torch_class),
        "state_kind": kinds.state_kind(torch_class),
        "param_access": "owner" if kinds.needs_whole(torch_class) else "flat",
    }
    if fixed["param_access"] == "owner" and not sizes.param_shapes:
        raise ValueError(
            f"optimizer {name} runs on whole parameters, each owned by one rank: its states "
            "depend on each parameter's shape and the owners' balance on each size, which a "
            "parameter count does not give; plan for an nn.Module (on the meta device) or a "
            "transformers config instead"
        )
    state_bytes = (
        kinds.state_bytes_per_param(torch_class, {})
        if torch_class is not None and fixed["optimizer"] == "elementwise"
        else 0
    )
    workload = Workload(
        sizes=sizes,
        micro_batch=micro_batch,
        seq=seq,
        micro_batches=micro_batches,
        recompute=recompute,
        state_bytes_per_param=state_bytes,
        whole_class=torch_class if fixed["param_access"] == "owner" else None,
    )
    table = load_rules(rules)
    overrides: dict[str, tuple[Any, ...]] = {}
    if fleet.gpus <= fleet.ranks_per_node:
        overrides["shard_groups"] = ("flat",)  # one node: nothing to replicate across
    if not fleet.native_mxfp8:
        overrides["fp8_recipe"] = tuple(r for r in CHOICES["fp8_recipe"] if r != "mxfp8")
    boxes = ok_points(table, fixed, choice_space(fixed, overrides), progress)
    coster = Coster(workload, fleet)
    candidates = _costed(boxes, coster, _group_sizes(fleet, shard_group_sizes), progress)
    if max_drift is not None:
        candidates = [c for c in candidates if c.numerics.total <= max_drift]
    fitting = ranked([c for c in candidates if c.fits], objective)
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: c.device_bytes)
    planning = Planning(
        sizes=sizes,
        fleet=fleet,
        workload=workload,
        optimizer=name,
        objective=objective,
        fitting=tuple(fitting),
        rejected=tuple(rejected),
        ok_points=sum(b.size for b in boxes),
        distinct=len(candidates),
        plans={},
    )
    front = [i for i, c in enumerate(fitting) if c.pareto][:resolve_top]
    finalists = sorted({*range(min(resolve_top, len(fitting))), *front})
    plans = {i: _checked_plan(planning, fitting[i], rules) for i in finalists}
    return Planning(**{**planning.__dict__, "plans": plans})


def _deepspeed_only() -> set[str]:
    from dtypeplan.resolver._optimizer_kind import DEEPSPEED_ONLY

    return {shown for shown, _ in DEEPSPEED_ONLY.values()}


def _group_sizes(fleet: Fleet, given: Sequence[int] | None) -> list[int]:
    """The shard group sizes tried for a hybrid layout: ``given`` (each dividing the fleet,
    below it), by default one node's GPUs (``shard_group_size: "auto"`` under torchrun)."""
    if given is None:
        return [fleet.ranks_per_node] if fleet.gpus > fleet.ranks_per_node else []
    sizes = list(given)
    for size in sizes:
        if not 1 <= size < fleet.gpus or fleet.gpus % size:
            raise ValueError(
                f"shard group size {size} must divide the {fleet.gpus} GPUs and be below it"
            )
    return sizes


def _normal(point: Mapping[str, Any]) -> dict[str, Any]:
    """``point`` with the dimensions that mean nothing there (the fp8 recipe without fp8) at
    their defaults, so that equal combinations compare equal."""
    normal = dict(point)
    for name, (requires, default) in _REQUIRES.items():
        if name in normal and any(normal.get(k) != v for k, v in requires.items()):
            normal[name] = default
    return normal


def _requires() -> dict[str, tuple[dict[str, Any], Any]]:
    from dtypeplan.resolver import DIMENSIONS

    return {
        name: (dict(dim.requires), dim.default_value)
        for name, dim in DIMENSIONS.items()
        if dim.requires
    }


_REQUIRES = _requires()
"""The dimensions that mean something only where others have a value (the fp8 recipe)."""


def _costed(
    boxes: Sequence[Box],
    coster: Coster,
    groups: Sequence[int],
    progress: Callable[[str], None] | None,
) -> list[Candidate]:
    """One candidate per distinct cost, the first in the table's order (the "not used" values
    come first, so the simplest config of equal cost is kept)."""
    seen: set[tuple[Any, ...]] = set()
    candidates: list[Candidate] = []
    for i, box in enumerate(boxes):
        if progress is not None and i % 1000 == 0:
            progress(f"costing box {i + 1}/{len(boxes)}, {len(candidates)} distinct costs")
        free = {n: _costed_values(n, v, box.fixed) for n, v in box.free.items()}
        for point in Box(box.fixed, free, box.rule_id, box.implementation).points():
            layouts: Sequence[int | None] = [None] if point["shard_groups"] == "flat" else groups
            for group in layouts:
                key = coster.key(point, group)
                if key not in seen:
                    seen.add(key)
                    point = _normal(point)
                    candidates.append(
                        coster.candidate(point, group, box.rule_id, box.implementation)
                    )
    if progress is not None:
        progress(f"{len(candidates)} distinct combinations costed\n")
    return candidates


def _costed_values(name: str, values: tuple[Any, ...], fixed: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of a box's free dimension worth costing: one where the dimension changes no
    cost (:data:`_COST_FREE`; the fp8 recipe without fp8); bf16 without fp16 for the
    accumulator, the wire and autocast, whose costs the two share (same bytes, both
    unmeasured)."""
    if name in _COST_FREE or (name.startswith("fp8_") and fixed.get("fp8") is False):
        return values[:1]
    if name in ("accum", "comm", "autocast") and "bf16" in values:
        return tuple(v for v in values if v != "fp16")
    return values


def config_of(
    candidate: Candidate, optimizer: str, workload: Workload, fleet: Fleet
) -> dict[str, Any]:
    """The ds_config that selects ``candidate``'s combination (``_normal`` values only)."""
    from dtypeplan.resolver import config_for
    from dtypeplan.resolver._dimensions import CORE_DIMENSIONS, DIMENSIONS

    # The core settings always (their defaults depend on each other through the rules file),
    # a feature only where it is used: the config a person would write.
    values = {
        name: value
        for name, value in candidate.values.items()
        if name in CORE_DIMENSIONS
        and not (name == "params" and value == "fp32")
        or name in DIMENSIONS
        and name not in CORE_DIMENSIONS
        and name not in ("optimizer", "state_kind", "param_access")
        and value != DIMENSIONS[name].default_value
    }
    config = config_for(values)
    zero = config.setdefault("zero_optimization", {})
    if candidate.shard_group_size is not None:
        zero["shard_group_size"] = candidate.shard_group_size
    if candidate.values["hierarchical_partitioning"]:
        zero["zero_hpz_partition_size"] = fleet.ranks_per_node
    config["optimizer"] = {"type": optimizer, "params": {}}
    config["train_micro_batch_size_per_gpu"] = workload.micro_batch
    config["gradient_accumulation_steps"] = workload.micro_batches
    return _without_nulls(config)


def _without_nulls(config: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _without_nulls(v) if isinstance(v, dict) else v
        for k, v in config.items()
        if v is not None
    }


def _checked_plan(
    planning: Planning, candidate: Candidate, rules: str | os.PathLike[str] | None
) -> Any:
    """``candidate``'s config resolved: OK, and its ``plan.memory()`` / ``plan.traffic()``
    equal to the candidate's figures (else a :class:`RuntimeError`: a silent wrong number is
    the worst outcome)."""
    from dtypeplan._api import resolve

    plan = resolve(planning.config(candidate), rules=rules)
    sizes, gpus = planning.sizes, planning.fleet.gpus
    problems = []
    if plan.status != "OK":
        problems.append(f"resolves {plan.status} ({plan.rule_id}: {plan.reason})")
    else:
        fp8 = sizes.fp8_weights if plan.fp8 else None
        memory = plan.memory(
            sizes.num_params,
            gpus,
            param_numels=sizes.param_numels,
            fp8_weights=fp8,
            param_shapes=sizes.named_shapes,
        )
        traffic = plan.traffic(
            sizes.num_params,
            gpus,
            micro_batches=planning.workload.micro_batches,
            fp8_weights=fp8,
            param_numels=sizes.param_numels,
        )
        if memory != dict(candidate.memory):
            problems.append(f"plan.memory() {memory} != {dict(candidate.memory)}")
        if traffic != candidate.traffic:
            problems.append(f"plan.traffic() {traffic} != {candidate.traffic}")
    if problems:
        raise RuntimeError(
            f"the planner's combination {dict(candidate.values)} (rule {candidate.rule_id}): "
            + "; ".join(problems)
        )
    return plan
