"""The rest of the model under a pipeline: one clipping norm and one skip decision for all stages.

Each pipeline stage's optimizer holds only its stage's parameters, and its step summary (the
squared norm, reduced over the data-parallel group) covers those alone. Clipping by that norm
clips every stage by a different factor, and an fp16 overflow on one stage would skip the step
there only: the loss scales part, and the stages train on gradients scaled apart. So the summary
is summed once more over the pipeline group (one rank of every other stage), as DeepSpeed's
pipeline engine does: every stage then reads the same whole-model norm, clips by the same
factor, and takes the same overflow decision, so the loss scales and skipped-step counts stay
equal without being exchanged.

The squared norm is summed unscaled (divided by each stage's own divisor, the loss scale times
what its reduction left undivided), so stages whose data-parallel reductions differ still add
like terms. It stays a 0-dim device tensor: no host sync beyond the one fp16 already takes.

:func:`pipeline_group_of` takes the group from what the caller has: a process group, a 1-D
``DeviceMesh``, a ``torch.distributed.pipelining`` stage, or a schedule (its stages, which must
then all be among the optimizer's parameters). :func:`remember` / :func:`remembered` carry the
group from ``prepare_model`` to ``build``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.errors import NotSupportedError, OptimizerUsageError

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "PipelineLink",
    "pipeline_group_of",
    "remember",
    "remembered",
    "stage_local_refusal",
]

_GROUP_OF_PARAM: dict[int, tuple[weakref.ref[torch.Tensor], dist.ProcessGroup]] = {}
"""The pipeline group ``prepare_model`` was given, by ``id`` of each prepared parameter (a
weak reference beside it: a tensor cannot be a ``WeakKeyDictionary`` key, its ``==`` is
elementwise)."""


def _noted(param: torch.Tensor) -> dist.ProcessGroup | None:
    entry = _GROUP_OF_PARAM.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def pipeline_group_of(source: Any) -> tuple[dist.ProcessGroup, list[torch.nn.Module]]:
    """The pipeline group in ``source`` and the stage modules it names (none for a bare group).

    ``source``: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["pp"]``), a pipeline stage
    (its ``group``; None there means the default group), or a schedule (its stages'). Raises
    TypeError for anything else.
    """
    if isinstance(source, dist.ProcessGroup):
        return source, []
    if type(source).__name__ == "DeviceMesh":
        if source.ndim != 1:
            raise TypeError(
                f"pipeline_group: a DeviceMesh of {source.ndim} dimensions; pass the pipeline's "
                'own dimension (mesh["pp"])'
            )
        return source.get_group(), []
    stages = getattr(source, "_stages", None) or [getattr(source, "_stage", source)]
    if all(hasattr(stage, "submod") and hasattr(stage, "group") for stage in stages):
        groups = {id(stage.group) for stage in stages}
        if len(groups) != 1:
            raise OptimizerUsageError(
                "pipeline_group: the schedule's stages on this rank use different process groups"
            )
        group = stages[0].group or dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        return group, [stage.submod for stage in stages]
    raise TypeError(
        "pipeline_group takes a torch.distributed ProcessGroup, a 1-D DeviceMesh, or a "
        f"torch.distributed.pipelining stage or schedule; got {type(source).__name__}"
    )


def remember(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Note ``group`` for the parameters of ``model`` (``prepare_model(pipeline_group=...)``)."""
    for param in model.parameters():
        key = id(param)

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            if _GROUP_OF_PARAM.get(key, (None,))[0] is ref:
                del _GROUP_OF_PARAM[key]

        _GROUP_OF_PARAM[key] = (weakref.ref(param, forget), group)


def remembered(params: Iterable[torch.Tensor]) -> dist.ProcessGroup | None:
    """The pipeline group ``prepare_model`` noted for ``params`` (None if for none of them).

    Raises where some parameters were prepared with a group and others not, or with others.
    """
    params = list(params)
    noted = [_noted(p) for p in params]
    groups = {id(g): g for g in noted if g is not None}
    if not groups:
        return None
    if len(groups) > 1 or any(g is None for g in noted):
        raise OptimizerUsageError(
            "build(): some of the parameters were prepared with another pipeline_group than the "
            "others, or with none; pass pipeline_group to every prepare_model call of this "
            "rank's stages, or to build"
        )
    return next(iter(groups.values()))


def stage_local_refusal(
    plan: PrecisionPlan, process_group: dist.ProcessGroup | None, call: str
) -> str | None:
    """Why ``call`` cannot decide for the whole model, or None where it can.

    Under a pipeline (``plan.pipeline_parallel``) without the pipeline group, the optimizer sees
    its stage alone. That matters where the step decides from the norm: clipping, fp16's
    overflow skip, ``check_nonfinite``. Where the data-parallel group is the whole world, no
    other rank holds another stage (one process, or every stage on each rank): nothing missing.
    """
    if not plan.pipeline_parallel or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == dist.get_world_size():
        return None
    needs = [
        name
        for name, used in (
            (f"gradient_clipping {plan.gradient_clipping:g}", plan.gradient_clipping > 0),
            ("fp16 loss scaling", plan.loss_scaling is not None),
            ("check_nonfinite", plan.check_nonfinite and plan.loss_scaling is None),
        )
        if used
    ]
    if call.startswith("clip_grad_norm_"):
        needs = [call]
    if not needs:
        return None
    return (
        f"{' and '.join(needs)} under pipeline parallelism, without the pipeline group: the "
        "optimizer holds only its stage's parameters, so it would clip by its stage's norm "
        "and skip an fp16 overflow on its stage alone (the stages' loss scales would part). "
        "Pass the group that holds the other stages: plan.prepare_model(model, process_group="
        "dp_group, pipeline_group=pp_group) or plan.build(params, process_group=dp_group, "
        "pipeline_group=...) with a ProcessGroup, mesh['pp'], the PipelineStage or the schedule "
        "(README: Pipeline parallelism)"
    )


class PipelineLink:
    """The optimizer's link to the other stages: the pipeline group and what it checks."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        plan: PrecisionPlan,
        data_parallel: dist.ProcessGroup | None,
        params: list[torch.Tensor],
        stage_modules: list[torch.nn.Module],
    ) -> None:
        if not plan.pipeline_parallel:
            raise OptimizerUsageError(
                "pipeline_group given for a plan resolved without pipeline parallelism; resolve "
                "with dtypeplan.resolve(config, pipeline_parallel=True)"
            )
        mine = {id(p) for p in params}
        for module in stage_modules:
            if any(id(p) not in mine for p in module.parameters() if p.requires_grad):
                raise OptimizerUsageError(
                    "pipeline_group: a stage of the schedule on this rank has parameters this "
                    "optimizer was not built on; build one optimizer over all of this rank's "
                    "stages (interleaved schedules hold several), so that the pipeline sums "
                    "each stage's norm once"
                )
        self.comm = Communicator(group)
        # A rank of another stage in the data-parallel group would count its stage twice.
        others = set(dist.get_process_group_ranks(group)) & set(
            dist.get_process_group_ranks(data_parallel or dist.group.WORLD)
        )
        if others != {dist.get_rank()}:
            raise NotSupportedError(
                f"pipeline_group shares ranks {sorted(others - {dist.get_rank()})} with the "
                "data-parallel group: it must hold one rank of each other stage and no replica "
                "of this one (mesh['pp'] beside mesh['dp'])"
            )
        self.comm.check_consistent(
            {
                "gradient_clipping": plan.gradient_clipping,
                "loss_scaling": plan.loss_scaling,
                "check_nonfinite": plan.check_nonfinite,
            }
        )

    def whole_model_sq_norm(self, stage_sq_norm: torch.Tensor, divisor: float) -> torch.Tensor:
        """The squared norm over every stage, scaled as ``stage_sq_norm`` (0-dim fp32)."""
        square = divisor * divisor
        unscaled = stage_sq_norm.reshape(1).double() / square
        self.comm.all_reduce_scalars(unscaled)
        return (unscaled * square).float().reshape(())
