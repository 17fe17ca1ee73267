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

Counting backward passes (DeepSpeed's ``gradient_accumulation_steps``): a schedule runs one
backward per stage module and micro-batch, so a rank that holds several stages (an interleaved
schedule) runs several per micro-batch, and the step's boundary is the last of them.
:func:`backward_passes_per_step` multiplies the micro-batches by the stage modules: the
schedule's stages where it was given to ``build`` (:func:`note_stages`), else the modules
``prepare_model`` readied (each stage module is prepared on its own). Where some parameter is
in none, the passes are not counted: the boundary is then ``step()`` itself, the same numbers
without the overlap. A schedule whose micro-batches do not divide the accumulation
steps is refused at build, on every rank, not inside the schedule on one of them.

A pipeline run that says so nowhere (a plan resolved without ``pipeline_parallel=True`` and
no ``pipeline_group``) would clip and skip by its stage alone: :func:`unannounced_pipeline`
finds a ``torch.distributed.pipelining`` stage holding the optimizer's parameters where the
data-parallel group is not the whole world, at build and at the first step.
"""

from __future__ import annotations

import gc
import itertools
import sys
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.errors import NotSupportedError, OptimizerUsageError

if TYPE_CHECKING:
    from dtypeplan.resolver._batch import AccumulationSteps
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "PipelineLink",
    "backward_passes_per_step",
    "note_stages",
    "pipeline_group_of",
    "remember",
    "remembered",
    "schedule_refusal",
    "stage_local_refusal",
    "stage_modules_on_rank",
    "unannounced_pipeline",
]

_PREPARED: dict[int, tuple[weakref.ref[torch.Tensor], dist.ProcessGroup | None, int]] = {}
"""Per ``id`` of each parameter ``prepare_model`` readied under a pipeline plan: a weak
reference to it (a tensor cannot be a ``WeakKeyDictionary`` key, its ``==`` is elementwise),
the pipeline group it was given (None: none) and which ``prepare_model`` call it was (one per
stage module)."""
_PREPARE_CALLS = itertools.count()


def _record(param: torch.Tensor) -> tuple[dist.ProcessGroup | None, int] | None:
    entry = _PREPARED.get(id(param))
    return (entry[1], entry[2]) if entry is not None and entry[0]() is param else None


def _noted(param: torch.Tensor) -> dist.ProcessGroup | None:
    record = _record(param)
    return None if record is None else record[0]


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


def remember(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Note the parameters of ``model`` as one stage module, with ``group`` (the
    ``pipeline_group`` given to ``prepare_model``; None: none)."""
    call = next(_PREPARE_CALLS)
    for param in model.parameters():
        _store(param, group, call)


def _store(param: torch.Tensor, group: dist.ProcessGroup | None, call: int) -> None:
    key = id(param)

    def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
        if _PREPARED.get(key, (None,))[0] is ref:
            del _PREPARED[key]

    _PREPARED[key] = (weakref.ref(param, forget), group, call)


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


def note_stages(modules: list[torch.nn.Module]) -> None:
    """Note each of a schedule's stage ``modules`` as one stage module (the pipeline group
    each parameter was prepared with stays noted)."""
    for module in modules:
        call = next(_PREPARE_CALLS)
        for param in module.parameters():
            _store(param, _noted(param), call)


def stage_modules_on_rank(params: Iterable[torch.Tensor]) -> int | None:
    """How many stage modules hold the trainable ``params`` (each runs its own backward per
    micro-batch): the ``prepare_model`` calls that readied them or the schedule's stages
    (:func:`note_stages`); None where some parameter is in none."""
    records = [_record(p) for p in params if p.requires_grad]
    if not records or any(r is None for r in records):
        return None
    return len({r[1] for r in records if r is not None})


def backward_passes_per_step(
    plan: PrecisionPlan, steps: AccumulationSteps | None, params: Iterable[torch.Tensor]
) -> AccumulationSteps | None:
    """``steps`` (micro-batches per step) as backward passes per step on this rank: under a
    pipeline, times the stage modules it holds; None where those are not known."""
    if steps is None or not plan.pipeline_parallel:
        return steps
    stages = stage_modules_on_rank(params)
    if stages is None or stages == 1:
        return None if stages is None else steps
    return steps._replace(
        micro_batches=steps.micro_batches * stages,
        source=f"{steps.micro_batches} micro-batches x {stages} pipeline stage modules on "
        f"this rank, each its own backward pass ({steps.source})",
    )


def schedule_refusal(source: Any, accumulation_steps: int | None) -> str | None:
    """Why the schedule ``source`` (None where ``source`` is no schedule) cannot run with
    ``accumulation_steps`` micro-batches per step: they are not a whole number of its steps,
    so the counted boundary would fall inside a schedule step, whose next backward on one
    rank would then be refused while the other stages wait for it."""
    micro_batches = getattr(source, "_n_microbatches", None)
    if accumulation_steps is None or not isinstance(micro_batches, int) or micro_batches < 1:
        return None
    if accumulation_steps % micro_batches == 0:
        return None
    return (
        f"gradient_accumulation_steps {accumulation_steps} is not a multiple of the pipeline "
        f"schedule's n_microbatches {micro_batches}: a step must end where a schedule step "
        "ends (DeepSpeed's pipeline runs gradient_accumulation_steps micro-batches per step). "
        f"Set gradient_accumulation_steps to {micro_batches} (or a multiple, for several "
        "schedule.step() calls per optimizer step), or n_microbatches to match"
    )


def unannounced_pipeline(
    plan: PrecisionPlan,
    process_group: dist.ProcessGroup | None,
    params: Iterable[torch.Tensor],
    call: str,
) -> str | None:
    """Why ``call`` is refused for a pipeline stage whose plan was resolved without
    ``pipeline_parallel=True``, or None (not a pipeline stage as far as can be seen).

    Looked for only where it would change numbers (the step decides from the norm, or
    ``call`` is ``clip_grad_norm_``) and the data-parallel group leaves other ranks out
    (else no other rank can hold another stage): then a ``torch.distributed.pipelining``
    stage holding these parameters, among the live objects (a schedule holds its stages).
    """
    if plan.pipeline_parallel or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == dist.get_world_size():
        return None
    decides = plan.gradient_clipping > 0 or plan.loss_scaling is not None or plan.check_nonfinite
    if not decides and not call.startswith("clip_grad_norm_"):
        return None
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None:  # nothing made a stage: the module was never imported
        return None
    mine = {id(p) for p in params}
    stage_class = stage_module._PipelineStageBase
    for obj in gc.get_objects():
        if isinstance(obj, stage_class) and any(id(p) in mine for p in obj.submod.parameters()):
            return (
                f"{call}: this optimizer's parameters are those of pipeline stage "
                f"{obj.stage_index} (a torch.distributed.pipelining stage), but the plan was "
                "resolved without pipeline_parallel=True and built without pipeline_group: "
                "each stage would clip by its own gradient norm and decide an fp16 overflow "
                "alone, where the whole model's decides. Resolve with dtypeplan.resolve(config, "
                "pipeline_parallel=True) and pass the group of the other stages: "
                "plan.prepare_model(stage_module, process_group=dp_group, pipeline_group="
                "pp_group) or plan.build(params, process_group=dp_group, pipeline_group=...) "
                "with a ProcessGroup, mesh['pp'], the PipelineStage or the schedule (README: "
                "Pipeline parallelism)"
            )
    return None


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
