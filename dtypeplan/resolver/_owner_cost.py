"""``plan.memory()`` and ``plan.traffic()`` of a plan whose optimizer needs each parameter whole
(``param_access: owner``): the model's parameters read and checked, then the byte models of the
owners' layout (``_memory.owner_memory_model``, ``_traffic.owner_traffic_model``).

Both figures depend on the model, not only on its size: the states on each parameter's shape
(``_optimizer_kind.whole_states``), the balance and every collective on each parameter's size.
So memory needs ``param_shapes`` and traffic ``param_numels`` (or the shapes); DeepSpeed's Muon
chooses its parameters by name, so for it the shapes come by name
(``{name: p.shape for name, p in model.named_parameters()}``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.comm._groups import check_shard_group_size
from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.muon import MuonWithAuxAdamW, muon_by_name
from dtypeplan.resolver._memory import owner_memory_model
from dtypeplan.resolver._traffic import Traffic, owner_traffic_model

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["ParamShapes", "owner_memory", "owner_traffic"]

ParamShapes = Sequence[Sequence[int]] | Mapping[str, Sequence[int]]
"""Each parameter's shape in the optimizer's order, or ``{name: shape}`` (``named_parameters``)."""


def _unsupported_layout(plan: PrecisionPlan, what: str, world_size: int) -> int | None:
    """The owners' layout runs flat or in shard groups with the communication dtype across, on
    the device, without ZeRO++: the table refuses the rest (a NotSupported plan still answers
    memory() and traffic() for the flat layouts). Returns the shard group size (checked to
    divide ``world_size``; None: flat)."""
    wire = plan.wire_across_groups
    given = [
        setting
        for setting, on in (
            (
                f"communication_data_type_across_groups {wire}",
                plan.shard_group_size is not None
                and wire not in (None, DTYPE_NAMES[plan.comm_dtype]),
            ),
            (
                "offload_optimizer / offload_param",
                (plan.offload_optimizer, plan.offload_param) != ("none", "none"),
            ),
            ("zero_hpz_partition_size", plan.hpz_partition_size > 1),
            ("fp8", bool(plan.fp8)),
        )
        if on
    ]
    if given:
        raise NotSupportedError(
            f"{what}(): the optimizer {plan.optimizer.type} runs on whole parameters, each owned "
            f"by one rank, which dtypeplan does not run with {', '.join(given)} (the plan is "
            "NotSupported): no figure would be true; remove the settings"
        )
    if plan.shard_group_size is None:
        return None
    return check_shard_group_size(plan.shard_group_size, world_size)


def _shapes(
    plan: PrecisionPlan, param_shapes: ParamShapes | None, what: str, argument: str
) -> tuple[list[tuple[int, ...]], list[bool]]:
    torch_class = plan.optimizer.torch_class
    if param_shapes is None:
        raise PrecisionConfigError(
            f"{what}(): the optimizer {plan.optimizer.type} runs on whole parameters, each owned "
            "by one rank: the figures depend on each parameter's shape (its states) and size "
            f"(the owners' balance); pass {argument} (e.g. param_shapes={{name: p.shape for "
            "name, p in model.named_parameters()}})"
        )
    if isinstance(param_shapes, Mapping):
        named = [(str(name), tuple(int(d) for d in shape)) for name, shape in param_shapes.items()]
        return [shape for _, shape in named], [muon_by_name(n, len(s)) for n, s in named]
    if torch_class is MuonWithAuxAdamW:
        raise PrecisionConfigError(
            f"{what}(): DeepSpeed's Muon chooses its matrices by name (no 'embed' or 'lm_head'), "
            "so param_shapes must map names to shapes: param_shapes={name: p.shape for name, p "
            "in model.named_parameters()}"
        )
    shapes = [tuple(int(d) for d in shape) for shape in param_shapes]
    return shapes, [len(shape) == 2 for shape in shapes]


def owner_memory(
    plan: PrecisionPlan,
    num_params: int,
    world_size: int,
    param_shapes: ParamShapes | None,
    param_numels: Sequence[int] | None,
) -> dict[str, int]:
    """``plan.memory()`` for the owners' layout."""
    shard_group_size = _unsupported_layout(plan, "memory", world_size)
    shapes, muon = _shapes(plan, param_shapes, "memory", "param_shapes")
    numels = [math.prod(shape) for shape in shapes]
    if sum(numels) != num_params or (param_numels is not None and list(param_numels) != numels):
        raise ValueError(
            f"memory(): param_shapes hold {sum(numels)} values in {len(numels)} parameters, "
            f"not num_params {num_params}" + (" and param_numels" if param_numels else "")
        )
    return owner_memory_model(
        shapes=shapes,
        takes_muon=muon,
        torch_class=plan.optimizer.torch_class,
        world_size=world_size,
        zero_stage=plan.zero_stage,
        param_dtype=plan.param_dtype,
        accum_dtype=plan.grad_accum_dtype,
        accumulator_sharded=plan.accumulator_sharded,
        master_dtype=plan.master_dtype,
        master_rounding=plan.master_rounding,
        exp_avg_dtype=plan.exp_avg_dtype,
        exp_avg_sq_dtype=plan.exp_avg_sq_dtype,
        shard_group_size=shard_group_size,
    )


def owner_traffic(
    plan: PrecisionPlan,
    num_params: int,
    world_size: int,
    micro_batches: int,
    param_numels: Sequence[int] | None,
) -> Traffic:
    """``plan.traffic()`` for the owners' layout."""
    shard_group_size = _unsupported_layout(plan, "traffic", world_size)
    if param_numels is None:
        raise PrecisionConfigError(
            f"traffic(): the optimizer {plan.optimizer.type} runs on whole parameters, each "
            "owned by one rank, with one collective per parameter: pass param_numels (each "
            "parameter's size, e.g. [p.numel() for p in model.parameters()])"
        )
    if sum(param_numels) != num_params:
        raise ValueError(
            f"traffic(): param_numels sum to {sum(param_numels)}, not num_params {num_params}"
        )
    return owner_traffic_model(
        param_numels=tuple(int(n) for n in param_numels),
        world_size=world_size,
        micro_batches=micro_batches,
        zero_stage=plan.zero_stage,
        accumulator_sharded=plan.accumulator_sharded,
        param_dtype=plan.param_dtype,
        master_dtype=plan.master_dtype,
        accum_dtype=plan.grad_accum_dtype,
        comm_dtype=DTYPE_NAMES[plan.comm_dtype],
        shard_group_size=shard_group_size,
    )
