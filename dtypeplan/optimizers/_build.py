"""The builder: a resolved plan plus the runtime objects -> the optimizer (and a ready model).

As torchtitan's ``build_optimizers(model_parts, config, ...)``, the builder lives with the
optimizers and takes what never lives in a plan: the parameters, the model, the process group.
It picks the class from the registry by the name the plan records for the case at hand: with a
process group (torch.distributed initialized) ``plan.implementation``, without one
``plan.single_process_implementation`` (ZeRO-3's FSDP2 needs a group; the rules table sends one
process to the flat sharded optimizer, which runs the same plan). So ``build`` returns exactly
the class the plan names, and no constructor swaps itself for another.

``dtypeplan/__init__.py`` installs these two functions behind :meth:`PrecisionPlan.build` and
:meth:`PrecisionPlan.prepare_model`, so the resolver imports nothing of this package.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dtypeplan._autocast import forward_under_autocast, params_without_autocast
from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import NotSupportedError, OptimizerUsageError, PrecisionConfigError
from dtypeplan.optimizers.contract import (
    MixedPrecisionOptimizer,
    WrapPolicy,
    convert_linears,
    get_implementation,
)
from dtypeplan.optimizers.grads import (
    PipelineLink,
    note_stages,
    pipeline_group_of,
    remember,
    remembered,
    schedule_refusal,
    stage_local_refusal,
    unannounced_pipeline,
)
from dtypeplan.resolver import PrecisionPlan, Status

__all__ = ["build_optimizer", "implementation_class", "prepare_model"]


def _distributed(process_group: dist.ProcessGroup | None) -> bool:
    """Whether the optimizer runs on a process group (else: one process, no communication)."""
    return process_group is not None or (dist.is_available() and dist.is_initialized())


def _refuse_missing_group(process_group: dist.ProcessGroup | None, call: str) -> None:
    """Refuse one process where the launcher started several (torchrun's ``WORLD_SIZE``).

    Built before the process group exists (before ``TrainingArguments``, which initializes
    it), the optimizer would run on one process with no communication: every rank would
    train alone, silently.
    """
    if _distributed(process_group):
        return
    world = os.environ.get("WORLD_SIZE", "")
    if world.strip().isdigit() and int(world) > 1:
        raise OptimizerUsageError(
            f"{call} with torch.distributed not initialized while the environment says there "
            f"are {int(world)} ranks (WORLD_SIZE={world}): the optimizer would run this rank "
            "alone and every rank would train its own model. Initialize the process group "
            "first (torch.distributed.init_process_group(...), or create the framework's "
            "TrainingArguments / Accelerator / Trainer before building), or pass "
            "process_group=..."
        )


def implementation_class(
    plan: PrecisionPlan, process_group: dist.ProcessGroup | None = None
) -> type[MixedPrecisionOptimizer]:
    """The registered class :func:`build_optimizer` makes for ``plan`` on ``process_group``.

    Raises :class:`PrecisionConfigError` (status Error) or :class:`NotSupportedError` (status
    NotSupported) with the plan's reason.
    """
    where = f"{plan.reason} (rule {plan.rule_id} at {plan.rule_location})"
    if plan.status == Status.ERROR:
        raise PrecisionConfigError(where)
    if plan.status == Status.NOT_SUPPORTED:
        raise NotSupportedError(where)
    name = plan.implementation_for(_distributed(process_group))
    assert name is not None, "an OK plan names its implementations"
    return get_implementation(name)


def prepare_model(
    plan: PrecisionPlan,
    model: torch.nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    wrap: WrapPolicy | None = None,
    pipeline_group: Any = None,
) -> torch.nn.Module:
    """Ready ``model`` for :func:`build_optimizer`, in place; returns it (a plan not OK: as is).

    Every stage casts the model whole to ``plan.param_dtype``: parameters, frozen ones too,
    and floating-point buffers (integer buffers stay). At stages 0-2 the trainable parameters'
    fp32 values are kept until ``build`` takes them as the master weights, so casting first
    loses no precision (``contract/model.py``). ZeRO-3 keeps the trainable parameters in fp32 (the
    sharded parameters are the masters) and shards the model with FSDP2, one unit per block;
    ``wrap`` (a set of module classes or a callable ``module -> bool``) chooses the units
    there and is ignored at the other stages (``fsdp2/units.py``). With ``torch_autocast`` the
    model's forward then runs under ``plan.autocast()`` (``dtypeplan/_autocast.py``). With fp8
    compute the eligible linear layers are converted first, before the cast and the sharding
    (``contract/fp8_compute.py``). ``pipeline_group`` (the group of the other pipeline stages,
    see :func:`build_optimizer`) is noted for the prepared parameters, and ``build`` on them
    takes it.
    """
    if plan.status != Status.OK:
        return model
    _refuse_missing_group(process_group, "plan.prepare_model(model)")
    cls = implementation_class(plan, process_group)
    convert_linears(
        model,
        plan,
        sharded_by_fsdp2=plan.implementation_for(_distributed(process_group)) == "fsdp2",
    )
    prepared = cls.prepare_model(model, plan=plan, process_group=process_group, wrap=wrap)
    forward_under_autocast(prepared, plan.autocast_dtype)
    if pipeline_group is not None or plan.pipeline_parallel:
        # One stage module per call: build counts them (grads/pipeline.py).
        group = None if pipeline_group is None else pipeline_group_of(pipeline_group)[0]
        remember(prepared, group)
    return prepared


def build_optimizer(
    plan: PrecisionPlan,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    process_group: dist.ProcessGroup | None = None,
    *,
    pipeline_group: Any = None,
) -> MixedPrecisionOptimizer:
    """The optimizer of ``plan`` for ``params`` on ``process_group`` (default: the default
    group when torch.distributed is initialized, else one process).

    ``pipeline_group``: under pipeline parallelism, the group of one rank of every stage (a
    ``ProcessGroup``, ``mesh["pp"]``, the ``PipelineStage`` or the schedule), over which the
    step's norm and overflow decision are summed (``grads/pipeline.py``); by default the one
    ``prepare_model`` was given for these parameters. Without it, a pipeline plan whose
    data-parallel group is not the whole world refuses clipping and fp16 here.
    """
    _refuse_missing_group(process_group, "plan.build(...)")
    cls = implementation_class(plan, process_group)
    linked = None if pipeline_group is None else pipeline_group_of(pipeline_group)
    if linked is not None and plan.pipeline_parallel:
        # Each stage module of the schedule runs its own backward per micro-batch: the
        # optimizer counts them (grads/pipeline.py).
        note_stages(linked[1])
    optimizer = cls(params, plan=plan, process_group=process_group)
    try:
        _link_pipeline(optimizer, plan, process_group, pipeline_group, linked)
    except BaseException:
        optimizer.close()
        raise
    _warn_if_forward_not_under_autocast(plan, optimizer)
    return optimizer


def _link_pipeline(
    optimizer: MixedPrecisionOptimizer,
    plan: PrecisionPlan,
    process_group: dist.ProcessGroup | None,
    pipeline_group: Any,
    linked: tuple[dist.ProcessGroup, list[torch.nn.Module]] | None,
) -> None:
    """Give ``optimizer`` the other stages, or refuse what would decide per stage without.

    ``linked``: ``pipeline_group_of(pipeline_group)``, None without a ``pipeline_group``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    group, stages = (remembered(params), []) if linked is None else linked
    if plan.pipeline_parallel:
        ranks = dist.get_world_size(process_group) if dist.is_initialized() else 1
        steps = plan.accumulation_steps(ranks)
        refusal = schedule_refusal(pipeline_group, None if steps is None else steps.micro_batches)
        if refusal is not None:
            raise OptimizerUsageError(refusal)
    if group is None:
        reason = stage_local_refusal(plan, process_group, "build")
        if reason is not None:
            raise NotSupportedError(reason)
        unannounced = unannounced_pipeline(plan, process_group, params, "build")
        if unannounced is not None:
            raise OptimizerUsageError(unannounced)
        return
    optimizer.pipeline = PipelineLink(
        group, plan=plan, data_parallel=process_group, params=params, stage_modules=stages
    )


def _warn_if_forward_not_under_autocast(
    plan: PrecisionPlan, optimizer: MixedPrecisionOptimizer
) -> None:
    """``torch_autocast`` without ``prepare_model``: forward would run in fp32 unless the
    program enters ``plan.autocast()`` itself, so say so once, at build."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = params_without_autocast(params, plan.autocast_dtype)
    if missing and plan.autocast_dtype is not None:
        warnings.warn(
            f"torch_autocast is {DTYPE_NAMES[plan.autocast_dtype]} but {len(missing)} of "
            f"{len(params)} parameters belong to no model that plan.prepare_model(model) "
            "readied: their forward runs in fp32 unless it is entered under "
            "`with plan.autocast():`. Call plan.prepare_model(model) before plan.build (it "
            "runs the model's forward under autocast, as DeepSpeed's engine does), or ignore "
            "this if the program enters plan.autocast() itself.",
            UserWarning,
            stacklevel=3,
        )
