"""The plan's report: the text of :meth:`PrecisionPlan.explain`.

The plan is data (``_plan.py``); this module writes it out: the decision, each effective
setting with where it came from, which update runs a low-precision cell, the bytes on the wire,
the config's ``"auto"`` values, warnings, DeepSpeed differences and the nearest supported
configs. Each dimension of the plan's point is a row, written as its record says
(``Dimension.label``, :meth:`Dimension.describe`, ``Dimension.origin_key``) unless a function
here writes it (``_WRITTEN``): a feature at its "not used" value has no row. The plan's class is
named for type checkers only (``_plan.py`` imports this module to run it).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan import _update_path as update_path
from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver._dimensions import CORE_DIMENSIONS, DIMENSIONS, Dimension
from dtypeplan.resolver._rules import Status

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["cuda_update", "explain", "host_update"]

Row = tuple[str, str, str]
"""(label, value, origins key) of a line of effective settings."""


def host_update(plan: PrecisionPlan) -> str | None:
    """Which update runs a low-precision cell on the host (``optimizers/kernels/one_pass.py``,
    ``update/pieces.py``), or None for fp32 masters with fp32 states (torch's fused
    kernel)."""
    states = {plan.exp_avg_dtype, plan.exp_avg_sq_dtype}
    if plan.master_dtype == torch.float32 and states == {"fp32"}:
        return None
    if not states <= {"fp32", "bf16"}:
        return "fp32 pieces around torch's fused Adam/AdamW (quantized states)"
    if (
        plan.master_rounding == "nearest"
        and plan.master_dtype == torch.bfloat16
        and plan.grad_accum_dtype == plan.master_dtype
        and states == {"bf16"}
    ):
        return "torch's fused Adam/AdamW on the bf16 tensors"
    return f"one pass, {update_path.path()}"


def cuda_update(plan: PrecisionPlan) -> str | None:
    """Which update runs a low-precision cell on a CUDA device (the registry,
    ``optimizers/update/``): the one-pass Triton kernel where it serves the cell
    and Triton is installed, else fp32 pieces; None for fp32 masters with fp32 states."""
    host = host_update(plan)
    if host is None or host.startswith("torch's fused"):
        return host
    if not {plan.exp_avg_dtype, plan.exp_avg_sq_dtype} <= {"fp32", "bf16"}:
        return host  # quantized moments: the same pieces on every device
    pieces = "fp32 pieces around torch's fused Adam/AdamW"
    if torch.float16 in (plan.master_dtype, plan.param_dtype):
        return f"{pieces} (the Triton kernel rounds to bf16 only)"
    if os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") == "0":
        return f"{pieces} (DTYPEPLAN_FUSED_KERNEL=0)"
    if importlib.util.find_spec("triton") is None:
        return f"{pieces} (Triton is not installed)"
    return "one pass, Triton (one launch per param group)"


def explain(
    plan: PrecisionPlan, num_params: int | None = None, world_size: int | None = None
) -> str:
    """:meth:`PrecisionPlan.explain`: a human-readable account of the decision and of every
    effective setting; with ``num_params`` and ``world_size``, also the bytes each rank sends
    per step (:meth:`PrecisionPlan.traffic`)."""
    lines = _decision(plan)
    rows = [
        *(row for dim in DIMENSIONS.values() for row in _dimension_rows(plan, dim)),
        *_update_rows(plan),
        *_setting_rows(plan),
    ]
    width = max(len(r[0]) for r in rows)
    value_width = min(max(len(r[1]) for r in rows), 12)
    for label, value, key in rows:
        lines.append(
            f"  {label:<{width}}  {value:<{value_width}}  <- {plan.origins.get(key, 'fixed')}"
        )
    lines += _run_notes(plan)
    lines += _sections(plan, num_params, world_size)
    return "\n".join(lines)


def _decision(plan: PrecisionPlan) -> list[str]:
    """The status, the implementations and the deciding rule."""
    head = f"status: {plan.status}"
    if plan.implementation:
        head += f" (implementation {plan.implementation!r})"
    lines = [head]
    if plan.single_process_implementation != plan.implementation:
        lines.append(
            f"without torch.distributed (one process): "
            f"implementation {plan.single_process_implementation!r}"
        )
    lines += [
        f"rule: {plan.rule_id} at {plan.rule_location}",
        f"reason: {plan.reason}",
        "",
        "effective settings:",
    ]
    return lines


def _dimension_rows(plan: PrecisionPlan, dim: Dimension) -> list[Row]:
    """The rows of one dimension: written here where ``_WRITTEN`` says, else the record's;
    a feature at its "not used" value has none (it would only lengthen the account)."""
    if dim.name in _WRITTEN:
        return _WRITTEN[dim.name](plan)
    value = plan.point[dim.name]
    if dim.name not in CORE_DIMENSIONS and value == dim.default_value:
        return []
    return [(dim.label, dim.describe(value), dim.origin_key)]


def _master_rows(plan: PrecisionPlan) -> list[Row]:
    rounding = "" if plan.master_dtype == torch.float32 else f", {plan.master_rounding}"
    return [("master weights", DTYPE_NAMES[plan.master_dtype] + rounding, "master_dtype")]


def _states_rows(plan: PrecisionPlan) -> list[Row]:
    value = (
        plan.optimizer_states
        if plan.exp_avg_dtype == plan.exp_avg_sq_dtype
        else f"exp_avg {plan.exp_avg_dtype}, exp_avg_sq {plan.exp_avg_sq_dtype}"
    )
    return [("optimizer states", value, "optimizer_states_dtype")]


def _shard_group_rows(plan: PrecisionPlan) -> list[Row]:
    if plan.shard_group_size is None:
        return []
    return [
        ("shard groups", f"{plan.shard_group_size} ranks each", "shard_group_size"),
        (
            "wire across groups",
            plan.wire_across_groups or DTYPE_NAMES[plan.comm_dtype],
            "wire_across_groups",
        ),
    ]


def _hpz_rows(plan: PrecisionPlan) -> list[Row]:
    if not plan.hierarchical_partitioning:
        return []
    text = f"on, secondary partition of {plan.hpz_partition_size} ranks"
    return [("hierarchical partitioning", text, "hierarchical_partitioning")]


def _fp8_rows(plan: PrecisionPlan) -> list[Row]:
    return [("fp8", _fp8_text(plan), "fp8")] if plan.fp8 else []


def _optimizer_kind_rows(plan: PrecisionPlan) -> list[Row]:
    return [("optimizer kind", plan.optimizer_kind, "optimizer_kind")]


_WRITTEN: dict[str, Callable[[PrecisionPlan], list[Row]]] = {
    "master": _master_rows,
    "states": _states_rows,
    "shard_groups": _shard_group_rows,
    "hierarchical_partitioning": _hpz_rows,
    "fp8": _fp8_rows,
    "fp8_recipe": lambda plan: [],  # in fp8's row
    "fp8_all_gather": lambda plan: [],
    "fp8_execution": lambda plan: [],
    "optimizer": _optimizer_kind_rows,  # always shown: it decides what can run
}
"""The dimensions whose rows need more of the plan than their value."""


def _update_rows(plan: PrecisionPlan) -> list[Row]:
    """Which update runs a low-precision cell, on the host and on a CUDA device."""
    host = host_update(plan)
    if host is None:
        return []
    return [
        ("host update", host, "master_dtype"),
        ("CUDA update", str(cuda_update(plan)), "master_dtype"),
    ]


def _setting_rows(plan: PrecisionPlan) -> list[Row]:
    """The rows of the settings that are no dtype: scaling, optimizer, clipping."""
    scaling = "off"
    ls = plan.loss_scaling
    if ls is not None:
        scaling = (
            f"static {ls.loss_scale:g}"
            if ls.loss_scale > 0
            else f"dynamic from 2**{ls.initial_scale_power}, window {ls.loss_scale_window}, "
            f"hysteresis {ls.hysteresis}, min {ls.min_loss_scale:g}"
        )
    return [
        ("loss scaling", scaling, "loss_scaling"),
        ("optimizer", f"{plan.optimizer.type} {_kwargs(plan.optimizer.params)}", "optimizer"),
        (
            "gradient clipping",
            f"global L2 norm {plan.gradient_clipping:g}" if plan.gradient_clipping else "off",
            "gradient_clipping",
        ),
        (
            "non-finite check",
            "on" if plan.check_nonfinite else "off",
            "check_nonfinite",
        ),
    ]


def _fp8_text(plan: PrecisionPlan) -> str:
    """fp8 compute in a line: the recipe, how it runs, the weights' all-gather."""
    how = {
        "native": "native fp8 matmuls",
        "emulated": "emulated (fp8 rounding, the matmul in high precision: this device has no "
        "fp8 kernels for the recipe, or fp8.emulate is true)",
        "unavailable": "unavailable on this device (fp8.emulate false)",
    }[plan.fp8_execution]
    gather = (
        f", weights all-gathered in {plan.fp8_all_gather.replace('param_dtype', 'the param dtype')}"
        if plan.zero_stage == 3
        else ""
    )
    excluded = ", ".join(plan.fp8_exclude_modules) or "none"
    return f"{plan.fp8_recipe}, {how}{gather}; linear layers left out: {excluded}"


def _run_notes(plan: PrecisionPlan) -> list[str]:
    """What the loop runs besides the optimizer: autocast, the scheduler, micro-batches."""
    lines: list[str] = []
    if plan.autocast_dtype is not None and plan.status == Status.OK:
        name = DTYPE_NAMES[plan.autocast_dtype]
        lines.append(
            f"  autocast: forward runs under torch.autocast(dtype={name}) (prepare_model "
            "installs it around the model; plan.autocast() for other code); parameters, "
            "gradients and master weights stay fp32"
            + ("; the loss is scaled as for fp16" if plan.loss_scaling is not None else "")
        )
    lines += _pipeline_note(plan)
    if plan.scheduler is not None:
        kind, params = plan.scheduler.get("type"), plan.scheduler.get("params", {})
        lines.append(
            f"  scheduler: {kind} {_kwargs(params)}  <- $.scheduler (plan.build_scheduler)"
        )
    steps, train, micro = plan._batch_sizes()
    if steps is not None:
        lines.append(
            f"  gradient accumulation steps: {steps}"
            "  <- $.gradient_accumulation_steps (the caller runs the micro-batches)"
        )
    elif train is not None and micro is not None:
        lines.append(
            f"  gradient accumulation steps: train_batch_size {train} / "
            f"(train_micro_batch_size_per_gpu {micro} x data-parallel ranks), worked out "
            "at build as DeepSpeed does  <- $.train_batch_size, "
            "$.train_micro_batch_size_per_gpu"
        )
    elif plan.gradient_accumulation_steps is not None:
        lines.append(
            f"  gradient accumulation steps: {plan.gradient_accumulation_steps}, the HF "
            'Trainer\'s default for "auto": not counted (the loop decides; fill it with '
            "auto={'gradient_accumulation_steps': N} to have the last backward known)"
        )
    return lines


def _pipeline_note(plan: PrecisionPlan) -> list[str]:
    """Under a pipeline, what the step decides from the norm needs the other stages' group."""
    if not plan.pipeline_parallel:
        return []
    needs = [
        name
        for name, used in (
            ("gradient clipping", plan.gradient_clipping > 0),
            ("fp16 loss scaling", plan.loss_scaling is not None),
            ("the non-finite check", plan.check_nonfinite and plan.loss_scaling is None),
        )
        if used
    ]
    if not needs:
        return [
            "  pipeline: each stage's optimizer steps its own parameters; nothing in the step "
            "depends on the other stages"
        ]
    return [
        f"  pipeline: {' and '.join(needs)} decide from the norm of the whole model, summed "
        "over the pipeline group: pass it as plan.prepare_model(model, process_group=dp_group, "
        "pipeline_group=pp_group) or plan.build(..., pipeline_group=...) (a ProcessGroup, "
        "mesh['pp'], the PipelineStage or the schedule). Without it, build refuses them "
        "where the data-parallel group is not the whole world, rather than clip or skip per "
        "stage"
    ]


def _sections(plan: PrecisionPlan, num_params: int | None, world_size: int | None) -> list[str]:
    """The traffic, the "auto" values, warnings, differences, ignored keys, alternatives."""
    lines: list[str] = []
    if num_params is not None and world_size is not None:
        try:
            lines += ["", plan.traffic(num_params, world_size).report()]
        except PrecisionConfigError as exc:  # the fp8 all-gather: the figure needs the model
            lines += ["", f"traffic: not estimated, {exc}"]
    if plan.auto_values:
        lines += ["", '"auto" values (path = value used <- where it came from):']
        lines += [f"  {a.describe()}" for a in plan.auto_values]
    if plan.warnings or plan.config_warnings:
        lines += ["", "warnings:"]
        lines += [f"  - {w}" for w in (*plan.warnings, *plan.config_warnings)]
    if plan.deepspeed_differences:
        lines += ["", "differences from DeepSpeed (and how to get DeepSpeed's behaviour):"]
        lines += [f"  - {d}" for d in plan.deepspeed_differences]
    if plan.ignored_keys:
        lines += ["", "ignored (DeepSpeed keys that change neither numbers nor memory):"]
        lines += [f"  {', '.join(plan.ignored_keys)}"]
    if plan.status != Status.OK:
        lines += ["", "nearest supported configs:"]
        if not plan.alternatives:
            lines.append("  none: no rule of this table is OK")
        for alt in plan.alternatives:
            changes = "; ".join(alt.changes)
            lines.append(f"  - {changes}  -> OK ({alt.implementation}, rule {alt.rule_id})")
    return lines


def _kwargs(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()) or "(torch defaults)"
