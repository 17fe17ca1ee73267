"""The param groups a user gives, as ``torch.optim`` takes them, checked before anything is built.

Listed as group dicts; a parameter listed twice, a complex or integer parameter, and an
implementation switch that cannot apply where the update runs are refused, naming the group
and the position; the other switches are taken out (dtypeplan chooses the inner optimizer's
path itself).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.optimizers.grads.ownership import user_stacklevel

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["IMPLEMENTATION_SWITCHES", "checked_param_groups", "refuse_sharded_parameters"]


IMPLEMENTATION_SWITCHES = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Arguments of torch optimizers that choose a code path, not the numbers: the inner optimizer's
own (dtypeplan picks its path), never the user-facing param groups'."""


def checked_param_groups(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], plan: PrecisionPlan
) -> list[dict[str, Any]]:
    """``params`` as a list of group dicts with listed params, refused where it cannot train
    (see the module's docstring), without implementation switches."""
    groups = _param_group_dicts(params)
    _refuse_duplicates(groups)
    _refuse_non_real(groups)
    _refuse_inapplicable_switches(groups, plan)
    return groups


def _param_group_dicts(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``params`` as torch.optim takes it, as a list of group dicts with listed params."""
    items: list[Any] = list(params)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for group in items:
        listed = group["params"]
        listed = [listed] if isinstance(listed, torch.Tensor) else list(listed)
        groups.append({**group, "params": listed})
    return groups


_SWITCHES_REFUSED_ON_CPU = ("capturable",)
"""Switches that change what torch can run, not only how fast: torch refuses ``capturable``
at the first step of a CPU group (its step counters must live on a CUDA-graph device)."""


def _refuse_inapplicable_switches(groups: list[dict[str, Any]], plan: PrecisionPlan) -> None:
    """Refuse, naming the group and the cause, a switch a param group sets that cannot apply
    to where its update runs, and take every switch out of the groups (dtypeplan chooses the
    inner optimizer's path itself, ``inner_optimizer``).

    ``capturable=True`` keeps the step on the device so that it can be captured in a CUDA
    graph: on a CPU group (or with the optimizer offloaded to the host) torch itself fails at
    the first step, so it is refused here rather than dropped. Elsewhere dtypeplan's step does
    its own host work between kernels, so it is not graph-capturable either: a warning says
    the switch is ignored. ``differentiable=True`` would differentiate through the update;
    the masters are updated outside autograd.
    """
    for index, group in enumerate(groups):
        if group.pop("differentiable", False):
            raise NotSupportedError(
                f"param group {index} sets differentiable=True, which differentiates through "
                "the optimizer's update; dtypeplan updates the master weights outside "
                "autograd. Leave differentiable False"
            )
        if not group.pop("capturable", False):
            continue
        tensors = [t[1] if isinstance(t, tuple) else t for t in group["params"]]
        devices = sorted({t.device.type for t in tensors})
        if plan.offload_optimizer != "none" or "cpu" in devices or not devices:
            where = (
                f"offload_optimizer {plan.offload_optimizer} (the update runs on the host)"
                if plan.offload_optimizer != "none"
                else f"parameters on {', '.join(devices) or 'cpu'}"
            )
            raise NotSupportedError(
                f"param group {index} sets capturable=True with {where}: capturable keeps the "
                "step counters on a CUDA-graph device, and torch.optim itself fails at the "
                "first step of a CPU group. Leave capturable False (dtypeplan chooses the "
                "update's path)"
            )
        warnings.warn(
            f"param group {index}: capturable=True is ignored; dtypeplan's step is not "
            "captured in a CUDA graph (it chooses its own update path), and the numbers are "
            "those of capturable=False",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    for group in groups:
        for switch in IMPLEMENTATION_SWITCHES:
            group.pop(switch, None)


def _refuse_non_real(groups: list[dict[str, Any]]) -> None:
    """Complex or integer parameters: the flat buffers hold one real floating dtype."""
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            tensor = param[1] if isinstance(param, tuple) else param
            if tensor.is_complex() or not tensor.is_floating_point():
                raise OptimizerUsageError(
                    f"param group {group_index} position {position} is a {tensor.dtype} tensor "
                    f"of shape {tuple(tensor.shape)}: dtypeplan trains real floating-point "
                    "parameters only (the plan casts them to one dtype); keep complex or integer "
                    "tensors out of build(), e.g. as buffers or with torch.view_as_real"
                )


def _refuse_duplicates(groups: list[dict[str, Any]]) -> None:
    """A parameter listed twice would be stepped twice (torch only warns): refuse it."""
    seen: dict[int, tuple[int, int]] = {}
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            tensor = param[1] if isinstance(param, tuple) else param
            if id(tensor) in seen:
                first_group, first_position = seen[id(tensor)]
                raise OptimizerUsageError(
                    f"a parameter of shape {tuple(tensor.shape)} is listed twice: param group "
                    f"{first_group} position {first_position} and param group {group_index} "
                    f"position {position}; list every parameter once (torch.optim would step "
                    "it twice)"
                )
            seen[id(tensor)] = (group_index, position)


def refuse_sharded_parameters(
    groups: list[dict[str, Any]], plan: PrecisionPlan, implementation: str
) -> None:
    """Refuse parameters FSDP2 sharded (DTensors) for an ``implementation`` of whole tensors.

    They come from a ZeRO-3 plan's ``prepare_model``: the model was readied by one plan and
    built by another (another stage, or a rules file whose implementation takes whole tensors;
    the rules loader refuses a built-in one that does not declare ZeRO-3, a user's
    registration may declare more than it serves), and the first collective over them would
    fail on every rank with no word of why.
    """
    from torch.distributed.tensor import DTensor

    sharded = sum(isinstance(p, DTensor) for g in groups for p in g["params"])
    if not sharded:
        return
    raise OptimizerUsageError(
        f"{sharded} parameters are DTensors (sharded, as ZeRO-3's prepare_model leaves them "
        f"on FSDP2), but this plan builds {implementation} (rule {plan.rule_id!r} at "
        f"{plan.rule_location}), which takes whole tensors. A model prepared with one plan "
        "(ZeRO-3 on fsdp2) and built with another (another stage, or rules that send ZeRO-3 "
        "to an implementation that does not serve sharded parameters) gets here: prepare and "
        "build with the same plan, or point the rules file's ZeRO-3 rule at implementation: "
        "fsdp2"
    )
